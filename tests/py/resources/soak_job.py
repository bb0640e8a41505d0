"""One rank of tests/py/resources/test_soak.py: thousands of mixed collectives and random point-to-point ops
with checked results; reports file descriptors and memory early and at the end."""

import argparse
import json
import os
import random
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import job_args
import rustc10d  # noqa: F401


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def one_step(rng: random.Random, rank: int, world: int):
    """An op chosen the same way on every rank (shared seed), checked against arithmetic."""
    n = rng.choice([1, 7, 100, 1000, 4096, 16384])
    op = rng.choice(["all_reduce", "broadcast", "all_gather", "reduce_scatter", "all_to_all", "p2p", "barrier"])
    if op == "all_reduce":
        t = torch.full((n,), float(rank))
        dist.all_reduce(t, async_op=True).wait()
        assert t[0].item() == world * (world - 1) / 2
    elif op == "broadcast":
        root = rng.randrange(world)
        t = torch.full((n,), float(rank))
        dist.broadcast(t, root)
        assert t[-1].item() == root
    elif op == "all_gather":
        out = torch.empty(n * world)
        dist.all_gather_into_tensor(out, torch.full((n,), float(rank)))
        assert out[n * (world - 1)].item() == world - 1
    elif op == "reduce_scatter":
        out = torch.empty(n)
        dist.reduce_scatter_tensor(out, torch.ones(n * world))
        assert out[0].item() == world
    elif op == "all_to_all":
        out = torch.empty(n * world)
        dist.all_to_all_single(out, torch.full((n * world,), float(rank)))
        assert out[-1].item() == world - 1
    elif op == "p2p":
        peer, tag = rank ^ 1, rng.randrange(1000)
        got = torch.empty(n)
        works = [dist.irecv(got, peer, tag=tag), dist.isend(torch.full((n,), float(rank)), peer, tag=tag)]
        rng.shuffle(works)
        for w in works:
            w.wait()
        assert got[0].item() == peer
    else:
        dist.barrier()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3000)
    a, store = job_args.parse(p)
    dist.init_process_group("rustc10d", store=store, rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=30))
    rng = random.Random(1234)
    warm = a.steps // 10
    for step in range(a.steps):
        one_step(rng, a.rank, a.world)
        if step == warm:
            early = {"fds": fds(), "rss_mb": rss_mb()}
    late = {"fds": fds(), "rss_mb": rss_mb()}
    dist.destroy_process_group()
    sys.stdout.write("RESULT " + json.dumps({"early": early, "late": late}) + "\n")


if __name__ == "__main__":
    main()
