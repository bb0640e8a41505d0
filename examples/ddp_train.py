"""Train a small MLP with DistributedDataParallel over rustc10d, on CPU.

    torchrun --nproc-per-node 2 examples/ddp_train.py [--backend gloo] [--steps 10]

Every rank trains on batches of its own; DDP averages the gradients across ranks, so every
replica takes the steps that one process would take on all ranks' batches at once. Rank 0 prints
the mean loss of each step and, at the end, "OK" when every rank's parameters match that
single-process training (which each rank also runs, locally); the job exits non-zero otherwise.
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

BATCH, IN, HIDDEN, OUT = 16, 10, 32, 3


def say(line: str):
    # one write per line: ranks share torchrun's (unbuffered) stdout
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial parameters on every rank
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch for `step`: any rank can make any rank's."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN, generator=g)
    return x, x[:, :OUT] * 2 - 1  # a target a small MLP can learn


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="rustc10d")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if args.backend == "rustc10d":
        import rustc10d  # noqa: F401  (registers the "rustc10d" backend with torch.distributed)

    dist.init_process_group(backend=args.backend)  # torchrun provides RANK, WORLD_SIZE, MASTER_*
    rank, world = dist.get_rank(), dist.get_world_size()

    model = DDP(make_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # the reference: one process training on every rank's batch at once
    reference = make_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)

    for step in range(args.steps):
        x, y = batch(rank, step)
        loss = F.mse_loss(model(x), y)
        loss.backward()  # DDP all-reduces the gradients here
        opt.step()
        opt.zero_grad()

        everyone = [batch(r, step) for r in range(world)]
        ref_loss = F.mse_loss(reference(torch.cat([b[0] for b in everyone])), torch.cat([b[1] for b in everyone]))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()

        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            say(f"step {step}: loss {mean_loss.item() / world:.5f}")

    errors = [f"[rank {rank}] parameter {name} differs from single-process training by "
              f"{(p - ref_p).abs().max().item():.2e}"
              for (name, p), ref_p in zip(model.module.named_parameters(), reference.parameters())
              if not torch.allclose(p, ref_p, rtol=1e-4, atol=1e-5)]
    for error in errors:
        say(error)

    # every rank learns whether all ranks were right
    all_ok = torch.tensor([0 if errors else 1])
    dist.all_reduce(all_ok, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    if all_ok.item() != 1:
        return 1
    if rank == 0:
        say("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
