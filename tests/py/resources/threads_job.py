"""One rank of the thread-count job: the world group plus GROUPS groups over every rank (as
DeviceMesh, FSDP and tensor parallelism create them), each used once, then the threads of this
process are counted; then every group is destroyed and they are counted again. Prints
`RESULT <json>`.

    harness.launch_ranks(8, ["--groups", "64"], script=threads_job.py, ...)   # see test_threads.py
"""

import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import job_args
import own_threads


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--backend", default="rustc10d")
    a, store = job_args.parse(p)
    if a.backend == "rustc10d":
        import rustc10d  # noqa: F401
    before = threads()
    dist.init_process_group(a.backend, store=store, rank=a.rank, world_size=a.world,
                            timeout=timedelta(seconds=120))
    groups = [dist.new_group(list(range(a.world))) for _ in range(a.groups)]
    for g in groups:
        t = torch.ones(4)
        dist.all_reduce(t, group=g)
        assert t.tolist() == [float(a.world)] * 4, t
    dist.barrier()
    live = threads()
    dist.barrier()
    for g in groups:
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    left = sorted(own_threads.names_after_joins())
    result = {"before": before, "live": live, "after": threads(), "left": left}
    sys.stdout.write("RESULT " + json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
