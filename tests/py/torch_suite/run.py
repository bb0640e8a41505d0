"""Runs torch's own conformance suite, DistributedTest (torch/testing/_internal/distributed/
distributed_test.py), against a backend at world size 2, on CPU, one test at a time.

    python tests/py/torch_suite/run.py                         # the tests in tests.txt, on rustc10d
    python tests/py/torch_suite/run.py test_barrier ...        # these tests
    python tests/py/torch_suite/run.py --all --backend gloo    # every test, on Gloo (makes the list)

Which tests run is decided as for Gloo: torch's decorators read the BACKEND environment
variable once, when distributed_test.py is imported, and skip most tests for any name but
"gloo" and "nccl" (a third-party backend cannot say it supports DDP, sparse tensors,
get_future, ...). So the module is imported with BACKEND=gloo, then BACKEND (the variable and
the module's global) becomes the backend under test, so that every process group the tests
create, the default one included, is that backend's. Tests whose bodies then branch on the name
(`if BACKEND == "gloo"`), or that an older torch refuses for any name but gloo's, fail for
every other backend: excluded.txt lists them, and --list leaves them out (except on Gloo).

Ranks are forked from this process, as torch's former test_distributed_fork.py did: spawning
them, as test_distributed_spawn.py does (--start spawn), re-imports torch's test modules, about
7 CPU-seconds a rank; the list took 653 s that way against 34 s forked (2 busy cores), with the
same outcomes.

Exit status: 0 when every test run passed or was skipped by torch itself, 1 when any failed,
timed out (torch's harness kills a test's ranks after DISTRIBUTED_TESTS_DEFAULT_TIMEOUT) or was
not started before --deadline, or when none passed. Listed names this torch lacks are named and
left out.
"""

import argparse
import json
import multiprocessing
import os
import re
import signal
import sys
import tempfile
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tests", nargs="*", help="test names (default: those in --list)")
    ap.add_argument("--list", default=os.path.join(HERE, "tests.txt"), help="file of test names, # comments")
    ap.add_argument("--excluded", default=os.path.join(HERE, "excluded.txt"), help="names --list leaves out")
    ap.add_argument("--all", action="store_true", help="every test DistributedTest has")
    ap.add_argument("--backend", default="rustc10d", help="backend under test (default rustc10d)")
    ap.add_argument("--start", choices=["fork", "spawn"], default="fork", help="how ranks start")
    ap.add_argument("--deadline", type=float, default=0, help="seconds; tests not started by then fail")
    ap.add_argument("--report", help="write each test's outcome and seconds to this JSON file")
    ap.add_argument("--logs", help="keep each test's output in this folder (default: a temporary one)")
    args = ap.parse_args()
    # Spawned ranks import this file again without these arguments: they read them from here.
    os.environ["TORCH_SUITE_BACKEND"] = args.backend
    os.environ["TORCH_SUITE_START"] = args.start
    return args


ARGS = parse_args() if __name__ == "__main__" else None

# Before torch is imported: CPU only (on a machine with fewer GPUs than ranks torch's harness
# skips every test), one thread a rank (ranks share the cores), Gloo on loopback.
os.environ["CUDA_VISIBLE_DEVICES"] = ""
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("WORLD_SIZE", "2")
# torch's limit per test (300 s by default, more for two DDP tests): a hung test fails sooner.
os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", "120")
os.environ.setdefault("TEMP_DIR", tempfile.gettempdir())  # read at import; each test makes its own
# file:// as torch's CI runs it in one of its configurations: test_barrier_timeout_global runs
# only then (it re-creates the default group, which over a TCP store torch found racy).
os.environ.setdefault("INIT_METHOD", f"file://{tempfile.gettempdir()}/torch-suite-init-{os.getpid()}")
TARGET = os.environ.get("TORCH_SUITE_BACKEND", "rustc10d")
START = os.environ.get("TORCH_SUITE_START", "fork")
os.environ["BACKEND"] = "gloo"

import rustc10d  # noqa: E402,F401  registers the backend, in spawned ranks too
import torch  # noqa: E402
from torch.testing._internal.distributed import distributed_test  # noqa: E402

os.environ["BACKEND"] = distributed_test.BACKEND = TARGET


class TestDistributed(distributed_test.TestDistBackend, distributed_test.DistributedTest._DistTestBase):
    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context(START).Process)


def run_one(name, log):
    """Runs one test, its ranks' output into log. Returns (outcome, seconds, detail)."""
    result = unittest.TestResult()
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    t0 = time.monotonic()
    with open(log, "wb") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            TestDistributed(name).run(result)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            for fd, old in zip((1, 2), saved):
                os.dup2(old, fd)
                os.close(old)
    seconds = time.monotonic() - t0
    if result.failures or result.errors:
        return "FAIL", seconds, "".join(text for _, text in result.failures + result.errors)
    if result.skipped:
        return "skip", seconds, result.skipped[0][1]
    return "pass", seconds, ""


def stop_ranks(signum, frame):
    """SIGTERM (CI's deadline): take the running test's ranks along, which torch would leave behind."""
    for p in multiprocessing.active_children():
        p.kill()
    os._exit(128 + signum)


def excluded(path):
    """{name: why} of the lines of `path` that apply to this torch: `name  # why` always,
    `name  torch<X.Y  # why` on releases before X.Y."""
    version = tuple(int(v) for v in re.findall(r"\d+", torch.__version__)[:2])
    out = {}
    with open(path) as f:
        for line in f:
            body, _, why = line.partition("#")
            name, *cond = body.split() or [None]
            below = [tuple(map(int, m.groups())) for m in map(re.compile(r"torch<(\d+)\.(\d+)$").match, cond) if m]
            if name and len(below) == len(cond) and all(version < b for b in below):
                out[name] = why.strip()
    return out


def main(args):
    signal.signal(signal.SIGTERM, stop_ranks)
    # Ranks keep SIGTERM's default: torch's harness ends a hung rank with it.
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    available = sorted(n for n in dir(TestDistributed) if n.startswith("test_"))
    left_out = {}
    if args.all:
        names = available
    elif args.tests:
        names = args.tests
    else:
        with open(args.list) as f:
            names = [n for n in (line.split("#")[0].strip() for line in f) if n]
        if TARGET != "gloo":  # what excluded.txt lists fails for any other name only
            left_out = {n: why for n, why in excluded(args.excluded).items() if n in names}
        names = [n for n in names if n not in left_out]
    missing = [n for n in names if n not in available]
    names = [n for n in names if n in available]
    print(f"torch {torch.__version__}, backend {TARGET}, world size {os.environ['WORLD_SIZE']}, ranks by {START}: "
          f"{len(names)} tests", flush=True)
    for name, why in left_out.items():
        print(f"left out on this torch (excluded.txt): {name}: {why}", flush=True)
    if missing:
        print(f"not in this torch, left out: {' '.join(missing)}", flush=True)
    logs = args.logs or tempfile.mkdtemp(prefix="torch-suite-")
    os.makedirs(logs, exist_ok=True)
    results, t_start = {}, time.monotonic()
    for i, name in enumerate(names, 1):
        if args.deadline and time.monotonic() - t_start > args.deadline:
            outcome, seconds, detail = "FAIL", 0.0, f"not started: the {args.deadline:.0f} s deadline had passed"
        else:
            outcome, seconds, detail = run_one(name, os.path.join(logs, name + ".log"))
        results[name] = {"outcome": outcome, "seconds": round(seconds, 2), "detail": detail}
        note = f"  ({detail.strip()})" if outcome == "skip" else ""
        print(f"[{i}/{len(names)}] {outcome} {seconds:5.1f} s  {name}{note}", flush=True)
    failed = [n for n, r in results.items() if r["outcome"] == "FAIL"]
    for name in failed:
        log = os.path.join(logs, name + ".log")
        tail = open(log, errors="replace").read()[-4000:] if os.path.exists(log) else ""
        print(f"\n===== FAIL {name}\n{results[name]['detail']}\n----- its ranks' output (tail), {log}:\n{tail}")
    counts = {o: sum(r["outcome"] == o for r in results.values()) for o in ("pass", "skip", "FAIL")}
    print(f"\n{counts['pass']} passed, {counts['skip']} skipped by torch, {counts['FAIL']} failed"
          f" ({', '.join(failed) or 'none'}), {len(missing)} not in this torch;"
          f" {time.monotonic() - t_start:.0f} s; logs in {logs}", flush=True)
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"torch": torch.__version__, "backend": TARGET, "missing": missing, "tests": results}, f, indent=1)
    return 1 if failed or not counts["pass"] else 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
