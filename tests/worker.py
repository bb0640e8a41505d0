"""One rank of a test job. harness.py starts these; pytest never imports this file.

  worker.py job  --rank R --world W --store HOST:PORT --out DIR [--job NAME]
      Run every check of job NAME (default "main") of checks.py meant for world size W, in
      order, recording each result in DIR/rank<R>.json as soon as it is known (so a job killed
      half-way still reports).
  worker.py init --rank R --world W (--store HOST:PORT | --host-store) --timeout S
      Only initialise the backend and do one all_reduce; on failure print
      "init failed after <s> s: ..." (or "first op failed ...") to stderr and exit 1.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import checks

# A broken collective must fail its check, not hang the job: the backend gets a short timeout,
# the Gloo group that re-syncs ranks between checks a longer one (it waits for the slowest
# rank's failing check), and a check still running after CHECK_TIMEOUT ends the job.
PG_TIMEOUT = checks.GROUP_TIMEOUT
SYNC_TIMEOUT = timedelta(seconds=120)
CHECK_TIMEOUT = 75


def init_backend(backend: str, store, rank: int, world: int, timeout: timedelta):
    if backend == "rustc10d":
        import rustc10d  # noqa: F401  (registers the "rustc10d" backend)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)


def connect_store(address: str, world: int) -> dist.Store:
    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), world, is_master=False, timeout=timedelta(seconds=60))


class Results:
    """This rank's results file, rewritten atomically on every change; shared with the
    watchdog thread."""

    def __init__(self, path: Path):
        self.path = path
        self.data = {"checks": {}, "current": None, "init_error": None, "aborted": None, "finished": False}
        self.lock = threading.Lock()
        self._flush()

    def set(self, **fields):
        with self.lock:
            self.data.update(fields)
            self._flush()

    def record(self, name, status, message="", seconds=0.0):
        with self.lock:
            self.data["checks"][name] = {"status": status, "message": message, "seconds": round(seconds, 3)}
            self.data["current"] = None
            self._flush()

    def _flush(self):
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


@contextlib.contextmanager
def deadline(seconds: float, on_expiry):
    """If the block still runs after `seconds`, call on_expiry(), dump every thread's stack and
    end the process: a backend that ignores its own timeout must not hold the job hostage."""

    def expire():
        on_expiry()
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def run_check(check: checks.Check, ctx: checks.Ctx, results: Results):
    results.set(current=check.name)
    ctx = dataclasses.replace(ctx, check=check.name, errors=[])
    t0 = time.monotonic()
    hung = f"hung: still running after {CHECK_TIMEOUT} s (process group timeout {PG_TIMEOUT}); job aborted"
    with deadline(CHECK_TIMEOUT, lambda: results.record(check.name, "fail", hung)):
        try:
            check.fn(ctx)
            raised = ""
        except Exception:
            raised = traceback.format_exc()
    message = "\n".join(ctx.errors + [raised]).strip()
    results.record(check.name, "fail" if message else "pass", message, time.monotonic() - t0)


def run_job(args) -> int:
    results = Results(Path(args.out) / f"rank{args.rank}.json")
    try:
        with deadline(CHECK_TIMEOUT, lambda: results.set(init_error=f"init hung for {CHECK_TIMEOUT} s")):
            store = connect_store(args.store, args.world)
            init_backend(checks.BACKEND, store, args.rank, args.world, PG_TIMEOUT)
            sync = dist.new_group(backend="gloo", timeout=SYNC_TIMEOUT)
    except Exception:
        results.set(init_error=traceback.format_exc())
        return 1
    ctx = checks.Ctx(args.rank, args.world, checks.BACKEND, scratch=args.out)
    for check in checks.runnable(args.world, checks.BACKEND, args.job):
        run_check(check, ctx, results)
        try:  # re-sync, so that one failed check does not desynchronise the next
            dist.barrier(group=sync)
        except Exception as e:
            results.set(aborted=f"re-sync after {check.name} failed: {e}")
            return 2
    with deadline(CHECK_TIMEOUT, lambda: results.set(aborted=f"destroy_process_group() hung for {CHECK_TIMEOUT} s")):
        dist.destroy_process_group()
    results.set(finished=True)
    return 0


def run_init(args) -> int:
    timeout = timedelta(seconds=args.timeout)
    t0 = time.monotonic()
    try:
        if args.host_store:
            store = dist.TCPStore("127.0.0.1", 0, args.world, is_master=True, wait_for_workers=False, timeout=timeout)
        else:
            store = connect_store(args.store, args.world)
        init_backend(checks.BACKEND, store, args.rank, args.world, timeout)
    except Exception as e:
        print(f"init failed after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [args.world] * 2, t
        dist.destroy_process_group()
    except Exception as e:
        print(f"first op failed after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"init ok after {time.monotonic() - t0:.1f} s", flush=True)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["job", "init"])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--store", help="HOST:PORT of the TCPStore to join")
    parser.add_argument("--host-store", action="store_true", help="host the TCPStore here (init only)")
    parser.add_argument("--out", help="results folder (job only)")
    parser.add_argument("--job", default="main", help="which checks to run (job only): see checks.Check.job")
    parser.add_argument("--timeout", type=float, default=30, help="process group timeout, s (init only)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # W ranks share few cores
    # harness.py stops a job past its deadline with SIGTERM: show where each thread was
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    return run_job(args) if args.mode == "job" else run_init(args)


if __name__ == "__main__":
    sys.exit(main())
