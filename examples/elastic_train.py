"""Train on with the survivors when a rank is lost: DistributedDataParallel over rustc10d on CPU,
one rank gone mid-run, the others shrink the group and go on.

    torchrun --nproc-per-node 4 examples/elastic_train.py [--steps 12] [--lost-rank 3] [--lost-at 5]

Every rank trains on batches of its own, as in ddp_train.py. At step `--lost-at`, rank
`--lost-rank` ends at once, as a crashed process does (with exit status 0, because torchrun's
agent stops every worker of a node when one fails; a rank lost on another node takes only that
node's agent with it). The survivors' next gradient all-reduce raises, naming the lost rank;
each survivor then calls dist.shrink_group([lost]), which re-forms the default group of the
survivors, wraps its model in a new DDP on it and takes the failed step again. Rank 0 prints
each step's loss and how long the recovery took, and at the end "OK" when every survivor's
parameters match one process that trained on what the survivors saw: every rank's batches
before the loss, the survivors' after. The job exits non-zero otherwise.
"""

import argparse
import os
import sys
import time

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
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT)).double()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch for `step` (a global rank): any rank can make any rank's."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(BATCH, IN, generator=g, dtype=torch.float64)
    return x, x[:, :OUT] * 2 - 1


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x, y) -> torch.Tensor:
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)
    loss.backward()  # DDP all-reduces the gradients here: a lost peer makes it raise
    opt.step()
    return loss.detach()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="rustc10d")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lost-rank", type=int, default=3)
    parser.add_argument("--lost-at", type=int, default=5)
    args = parser.parse_args()
    if args.backend == "rustc10d":
        import rustc10d  # noqa: F401  (registers the "rustc10d" backend with torch.distributed)

    dist.init_process_group(backend=args.backend)  # torchrun provides RANK, WORLD_SIZE, MASTER_*
    rank, world = dist.get_rank(), dist.get_world_size()  # global ranks; `rank` stays this one's name
    assert 0 < args.lost_rank < world and 0 < args.lost_at < args.steps, "lose a rank but 0, mid-run"
    members = list(range(world))

    net = make_model()
    model = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    reference = make_model()  # one process, on what the survivors saw
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.05)

    step = 0
    while step < args.steps:
        if step == args.lost_at and rank == args.lost_rank:
            os._exit(0)  # gone without a word, as a crash
        try:
            loss = train_step(model, opt, *batch(rank, step))
        except dist.DistError as e:
            # A peer is gone. Here it is known which; a real job would learn it from its
            # launcher or a health check, as torch's shrink_group leaves it to the caller.
            t0 = time.perf_counter()
            dist.shrink_group([members.index(args.lost_rank)])
            members.remove(args.lost_rank)
            model = DDP(net)  # on the new default group; the parameters agree already
            if rank == 0:
                say(f"step {step}: lost rank {args.lost_rank} ({type(e).__name__}); shrank to "
                    f"{dist.get_world_size()} ranks in {(time.perf_counter() - t0) * 1e3:.1f} ms")
            continue  # the failed step again, with the survivors
        ref_opt.zero_grad()
        xs, ys = zip(*(batch(r, step) for r in members))
        F.mse_loss(reference(torch.cat(xs)), torch.cat(ys)).backward()
        ref_opt.step()
        mean_loss = loss.clone()
        dist.all_reduce(mean_loss)
        if rank == 0:
            say(f"step {step}: loss {mean_loss.item() / len(members):.5f} on {len(members)} ranks")
        step += 1

    errors = [f"[rank {rank}] parameter {name} differs from single-process training by "
              f"{(p - ref_p).abs().max().item():.2e}"
              for (name, p), ref_p in zip(net.named_parameters(), reference.parameters())
              if not torch.allclose(p, ref_p, rtol=1e-9, atol=1e-12)]
    for error in errors:
        say(error)
    all_ok = torch.tensor([0 if errors else 1])
    dist.all_reduce(all_ok, op=dist.ReduceOp.MIN)
    dist.destroy_process_group()
    if all_ok.item() != 1 or len(members) != world - 1:
        return 1
    if rank == 0:
        say("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
