"""One rank of tests/py/resources/test_soak.py's group churn: a group made, used and destroyed every step,
as a job that makes a group per step does (on the default group's connections; every 100th
step one with connections of its own). Every step's all_reduce is checked. Reports what the
process holds early (after the warm-up), half-way through the rest, and at the end: file descriptors, threads, memory,
/dev/shm entries, and the entries rustc10d keeps about groups (`_native.retained`)."""

import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import job_args
import rustc10d


def held() -> dict:
    with open("/proc/self/status") as f:
        status = {line.split(":")[0]: line.split()[1] for line in f if line.startswith(("VmRSS", "RssAnon", "RssShmem"))}
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "rss_mb": int(status["VmRSS"]) / 1024,
        # Private memory: what a leak grows (shared memory is mapped segments, counted as touched).
        "anon_mb": int(status["RssAnon"]) / 1024,
        "shmem_mb": int(status["RssShmem"]) / 1024,
        "dev_shm": len(os.listdir("/dev/shm")),
        "retained": rustc10d._native.retained(dist.group.WORLD.group_name),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    args, store = job_args.parse(parser)
    dist.init_process_group("rustc10d", store=store, rank=args.rank, world_size=args.world,
                            timeout=timedelta(seconds=60))
    rank, world = args.rank, args.world
    early = mid = None
    for step in range(args.steps):
        if step == args.warmup:
            early = held()
        if step == (args.warmup + args.steps) // 2:
            mid = held()
        # Every rank calls new_group; half the steps the group leaves the last rank out.
        ranks = list(range(world)) if step % 2 == 0 else list(range(world - 1))
        own = rustc10d.Options(share_connections=False) if step % 100 == 49 else None
        group = dist.new_group(ranks, pg_options=own, timeout=timedelta(seconds=60))
        if rank in ranks:
            t = torch.full((4,), float(rank + step))
            try:
                dist.all_reduce(t, group=group)
            except RuntimeError as e:
                print(f"step {step}: {e}", file=sys.stderr)
                return 1
            expected = sum(r + step for r in ranks)
            if t.tolist() != [float(expected)] * 4:
                print(f"step {step}: all_reduce gave {t.tolist()}, expected {expected}", file=sys.stderr)
                return 1
        dist.destroy_process_group(group)
    dist.barrier()
    # The last groups' connections close on the I/O thread, a moment after destroy returns.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and held()["fds"] > early["fds"]:
        time.sleep(0.05)
    late = held()
    print("RESULT " + json.dumps({"early": early, "mid": mid, "late": late, "steps": args.steps}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
