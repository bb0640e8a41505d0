"""Train a small model split into pipeline stages, one per rank, with torch.distributed.pipelining
over rustc10d, on CPU.

    torchrun --nproc-per-node 2 examples/pipeline_train.py [--backend gloo] [--schedule 1f1b]

Rank 0 feeds each step's batch as micro-batches; activations and gradients travel between the
stages by send/recv. The last rank computes the loss and prints it each step. At the end every
rank checks its stage against the whole model trained in one process (which each rank also runs,
locally), and rank 0 prints "OK" when all stages match; the job exits non-zero otherwise.
"""

import argparse
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

BATCH, MICRO_BATCHES, WIDTH = 16, 4, 8
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def say(line: str):
    # one write per line: ranks share torchrun's (unbuffered) stdout
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make_stages(n: int) -> list[nn.Module]:
    torch.manual_seed(0)  # every rank builds the same whole model, and keeps its own stage
    return [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(n)]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, WIDTH, generator=g)
    return x, torch.sin(x).flip(1)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="rustc10d")
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.backend == "rustc10d":
        import rustc10d  # noqa: F401  (registers the "rustc10d" backend with torch.distributed)

    dist.init_process_group(backend=args.backend)  # torchrun provides RANK, WORLD_SIZE, MASTER_*
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2:
        print("run with at least 2 processes, e.g. torchrun --nproc-per-node 2", file=sys.stderr)
        return 2
    first, last = rank == 0, rank == world - 1

    module = make_stages(world)[rank]
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    pipeline = SCHEDULES[args.schedule](stage, n_microbatches=MICRO_BATCHES, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    # the reference: the whole model in one process, on the whole batch
    reference = nn.Sequential(*make_stages(world))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)

    for step in range(args.steps):
        x, y = batch(step)
        losses = []
        if first:
            pipeline.step(x)
        elif last:
            pipeline.step(target=y, losses=losses)
        else:
            pipeline.step()
        opt.step()
        opt.zero_grad()

        # the schedule averages the micro-batches' gradients: the whole batch's mean loss
        F.mse_loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if last:
            say(f"step {step}: loss {torch.stack(losses).mean().item():.5f}")

    errors = [f"[rank {rank}] stage parameter {name} differs from single-process training by "
              f"{(p - ref_p).abs().max().item():.2e}"
              for (name, p), ref_p in zip(module.named_parameters(), reference[rank].parameters())
              if not torch.allclose(p, ref_p, rtol=1e-4, atol=1e-6)]
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
