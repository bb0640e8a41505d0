"""tests/py/resources/test_soak.py's group churn with kills (torch 2.14 on: reconfigure). Three processes form
the default group by `dist._reconfigure`; every step each makes a group (all three, or the two
survivors), all_reduces in it (checked) and destroys it. Processes 0 and 1 live to the end. The
third is killed (SIGKILL, by itself, just after making a group of all three, so that it dies
holding its part of it) half-way through each of the first `--kills` generations; the launcher
starts a new process in its place, and the survivors, whose all_reduce fails, reconfigure with it
into the next generation. The survivors report what they hold after the warm-up generations,
half-way and at the end (file descriptors, threads, memory, /dev/shm entries), and how long each
all_reduce with a killed process took to fail.

`--launch` runs the launcher: it hosts the Store, starts and replaces the processes, and prints
one line `RESULT {...}` with the survivors' reports and every replacement's exit status."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import group_churn_job

SURVIVORS = 2


def settled() -> dict:
    """What the process holds, the fewest descriptors, threads and /dev/shm entries seen over a
    second: just after a kill, the last generation's connections and threads end a moment after
    the reconfigure returns (a leak stays through the second)."""
    samples = []
    for _ in range(20):
        samples.append(group_churn_job.held())
        time.sleep(0.05)
    return {**samples[-1], **{k: min(s[k] for s in samples) for k in ("fds", "threads", "dev_shm")}}


def members(generation: int) -> list[int]:
    """The processes of a generation, in rank order: the survivors and that generation's third."""
    return [*range(SURVIVORS), SURVIVORS + generation]


def reconfigure(store, generation: int, me: int):
    """Form the default group of `generation` with its members' handles, placed by position."""
    store.set(f"g{generation}/{me}", dist._get_reconfigure_handle())
    handles = [store.get(f"g{generation}/{p}").decode() for p in members(generation)]
    dist._reconfigure(uuid=generation + 1, handles=handles).wait()
    # torch names new groups by a per-process count: a new process starts it at 0, so each
    # generation starts every member's count at one value.
    dist.distributed_c10d._world.group_count = (generation + 1) * 1_000_000


def worker(args) -> int:
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, timeout=timedelta(seconds=60))
    me, generation = args.id, args.generation
    dist.init_process_group("rustc10d", store=store, rank=min(me, SURVIVORS), world_size=SURVIVORS + 1,
                            timeout=timedelta(seconds=30), enable_reconfigure=True)
    reports, failed_in = {}, []
    while generation <= args.kills:
        t0 = time.monotonic()
        reconfigure(store, generation, me)
        t1 = time.monotonic()
        rank = dist.get_rank()
        victim = generation < args.kills and rank == SURVIVORS
        for step in range(args.steps):
            ranks = [0, 1, 2] if step % 2 == 0 else [0, 1]
            group = dist.new_group(ranks, timeout=timedelta(seconds=30))  # every rank, as torch wants
            if victim and step == args.steps // 2:
                os.kill(os.getpid(), signal.SIGKILL)
            if rank not in ranks:
                continue
            t = torch.full((4,), float(rank + step))
            started = time.monotonic()
            try:
                dist.all_reduce(t, group=group)
            except dist.DistError as e:
                if len(ranks) == 3 and generation < args.kills and step == args.steps // 2:
                    failed_in.append(time.monotonic() - started)
                    dist.destroy_process_group(group)
                    break  # the third was killed: on to the next generation
                print(f"generation {generation} step {step}: {e}", file=sys.stderr)
                return 1
            expected = sum(r + step for r in ranks)
            if t.tolist() != [float(expected)] * 4:
                print(f"generation {generation} step {step}: {t.tolist()}, expected {expected}", file=sys.stderr)
                return 1
            dist.destroy_process_group(group)
        print(f"generation {generation}: reconfigured in {t1 - t0:.2f} s, steps took {time.monotonic() - t1:.2f} s",
              file=sys.stderr, flush=True)
        # Measured after a kill each time (the last generation has connections to its third).
        if me < SURVIVORS and generation in (args.warmup, (args.warmup + args.kills) // 2, args.kills - 1):
            reports[str(generation)] = settled()
        generation += 1
    dist.barrier()
    if me < SURVIVORS:
        print("RESULT " + json.dumps({"held": reports, "failed_in": failed_in}), flush=True)
    dist.destroy_process_group()
    return 0


def launch(args) -> int:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=args.timeout))
    here = os.path.abspath(__file__)

    def start(pid: int, generation: int) -> subprocess.Popen:
        cmd = [sys.executable, here, "--port", str(store.port), "--id", str(pid), "--generation", str(generation),
               "--kills", str(args.kills), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        # To files: a pipe nobody reads until the end would stop a process that logs much.
        with open(f"{args.log_dir}/p{pid}.out", "w") as out, open(f"{args.log_dir}/p{pid}.err", "w") as err:
            return subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL)

    procs = {p: start(p, 0) for p in members(0)}
    deadline = time.monotonic() + args.timeout
    killed = []
    try:
        for generation in range(args.kills):
            third = procs[SURVIVORS + generation]
            code = third.wait(timeout=max(1.0, deadline - time.monotonic()))
            killed.append(code)
            procs[SURVIVORS + generation + 1] = start(SURVIVORS + generation + 1, generation + 1)
        for proc in procs.values():
            proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    result = {"killed": killed, "codes": {p: proc.returncode for p, proc in procs.items()},
              "reports": {}, "errors": {}}
    for p in procs:
        with open(f"{args.log_dir}/p{p}.out") as out, open(f"{args.log_dir}/p{p}.err") as err:
            line = next((line for line in out if line.startswith("RESULT ")), None)
            if line:
                result["reports"][p] = json.loads(line[len("RESULT "):])
            if procs[p].returncode not in (0, -signal.SIGKILL):
                result["errors"][p] = err.read()[-3000:]
    print("RESULT " + json.dumps(result), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--launch", action="store_true")
    p.add_argument("--port", type=int)
    p.add_argument("--id", type=int)
    p.add_argument("--generation", type=int, default=0)
    p.add_argument("--kills", type=int, default=12)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--warmup", type=int, default=2, help="generations before the first report")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--log-dir", default=".", help="where each process's output goes (p<id>.out, .err)")
    args = p.parse_args()
    return launch(args) if args.launch else worker(args)


if __name__ == "__main__":
    sys.exit(main())
