"""Launches test processes for pytest and reads their results back.

Ranks of a job are worker.py processes joined through a TCPStore hosted by this (the pytest)
process on a port the OS picks, so there is no free-port race. Every process started here runs
in its own session and is killed when its deadline passes, so a hung backend fails the suite
instead of hanging CI.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import checks

REPO = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("worker.py")
JOB_TIMEOUT = 300  # one job runs every check of the main job, or of one stack, for one world size


@dataclass
class Proc:
    name: str
    returncode: int | None  # None: killed at the deadline
    seconds: float
    stdout_path: Path
    stderr_path: Path

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def describe(self, tail=3000) -> str:
        state = "killed at the deadline" if self.returncode is None else f"exit code {self.returncode}"
        return f"{self.name}: {state} after {self.seconds:.1f} s; stderr tail:\n{self.stderr[-tail:]}"


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    # Jobs live beside their tests (tests/py/<subject>/) and import the shared harness here.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parent), env.get("PYTHONPATH")]))
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the re-sync group is Gloo; all ranks are local
    env.update(extra or {})
    return env


def run_processes(cmds: dict[str, list[str]], *, timeout: float, log_dir: Path, env=None) -> list[Proc]:
    """Run the commands concurrently (name -> argv), output to log_dir/<name>.out/.err; kill
    whatever still runs after `timeout` seconds (also when the caller is interrupted)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    running, done = {}, {}
    try:
        for name, cmd in cmds.items():
            with open(log_dir / f"{name}.out", "wb") as out, open(log_dir / f"{name}.err", "wb") as err:
                running[name] = subprocess.Popen(cmd, cwd=REPO, env=env or worker_env(), stdout=out,
                                                 stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        while running and time.monotonic() - t0 < timeout:
            for name, p in list(running.items()):
                if p.poll() is not None:
                    done[name] = (p.returncode, time.monotonic() - t0)
                    del running[name]
            time.sleep(0.05)
    finally:
        _stop(running.values())
        for name in running:
            done[name] = (None, time.monotonic() - t0)
    return [Proc(name, *done[name], log_dir / f"{name}.out", log_dir / f"{name}.err") for name in cmds]


def _stop(procs, grace=5.0):
    """SIGTERM first (worker.py dumps its Python stacks, torchrun stops its workers), then
    SIGKILL to the session of each process that is still running."""
    procs = list(procs)
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # still running, so its session id is still its own
            p.wait()


def launch_ranks(world: int, args: list[str], *, timeout: float, log_dir: Path, env=None,
                 script: Path = WORKER, prefix: tuple[str, ...] = ()) -> list[Proc]:
    """Run `script <args>` (default worker.py) as ranks 0..world-1 around a fresh TCPStore,
    each command after `prefix` (say, `unshare --pid --fork`)."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout))
    cmds = {
        f"rank{r}": [*prefix, sys.executable, str(script), *args, "--rank", str(r), "--world", str(world),
                     "--store", f"127.0.0.1:{store.port}"]
        for r in range(world)
    }
    procs = run_processes(cmds, timeout=timeout, log_dir=log_dir, env=env)
    del store  # kept alive until every rank is gone
    return procs


class Job:
    """Every check of one job (checks.Check.job) for one world size, run once; `verify(name)`
    reports one check's outcome."""

    def __init__(self, world: int, log_dir: Path, job: str = "main", transport: str = "auto",
                 extra_env: dict[str, str] | None = None):
        self.world, self.log_dir = world, log_dir
        env = worker_env({**VARIANTS, **EXTRA_VARIANTS}.get(transport, {"RUSTC10D_TRANSPORT": transport}))
        env.update(extra_env or {})
        self.procs = launch_ranks(world, ["job", "--job", job, "--out", str(log_dir)],
                                  timeout=checks.JOB_TIMEOUTS.get(job, JOB_TIMEOUT), log_dir=log_dir, env=env)
        self.results = [self._load(r) for r in range(world)]

    def _load(self, rank) -> dict:
        try:
            return json.loads((self.log_dir / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            return {"checks": {}}

    def verify(self, name: str):
        outcomes = [res["checks"].get(name) for res in self.results]
        problems = []
        for rank, outcome in enumerate(outcomes):
            if outcome is None:
                verb = "did not finish" if self.results[rank].get("current") == name else "did not run"
                problems.append(f"--- rank {rank}: {verb}; {self.why_stopped(rank)}")
            elif outcome["status"] == "fail":
                problems.append(f"--- rank {rank} failed:\n{outcome['message']}")
        if problems:
            pytest.fail(f"{name} (world size {self.world}, logs in {self.log_dir}):\n" + "\n".join(problems),
                        pytrace=False)

    def verify_clean_exit(self):
        """After its checks every rank destroyed the process group and exited 0."""
        for rank, proc in enumerate(self.procs):
            if not (proc.returncode == 0 and self.results[rank].get("finished")):
                pytest.fail(f"world size {self.world}, rank {rank}: {self.why_stopped(rank)}", pytrace=False)

    def died_before(self, name: str) -> bool:
        """A rank ended (crashed, or killed at a deadline) before it started check `name`."""
        return any(not res.get("finished") and res["checks"].get(name) is None and res.get("current") != name
                   for res in self.results)

    def why_stopped(self, rank: int) -> str:
        res = self.results[rank]
        reasons = [f"{key}: {res[key]}" for key in ("init_error", "aborted") if res.get(key)]
        if res.get("current"):
            reasons.append(f"was running {res['current']}")
        return "\n".join(reasons + [self.procs[rank].describe()])


class JobCache:
    """Starts a job for a world size the first time a test asks for it."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.jobs: dict[tuple[int, str, str], Job] = {}

    def get(self, world: int, job: str = "main", transport: str = "auto") -> Job:
        if (world, job, transport) not in self.jobs:
            name = f"job-w{world}" + ("" if job == "main" else f"-{job}") + ("" if transport == "auto" else f"-{transport}")
            self.jobs[world, job, transport] = Job(world, self.tmp_path_factory.mktemp(name), job, transport)
        return self.jobs[world, job, transport]

    def verify(self, world: int, check: str, transport: str = "auto"):
        """Report one check's outcome, from the job that runs it."""
        self.get(world, checks.CHECKS[check].job, transport).verify(check)


# RUSTC10D_TRANSPORT values the collective and p2p suites run under: every rank of a test job is
# on this host, so "auto" means shared memory; "tcp" forces loopback TCP. Gloo has one path.
TRANSPORTS = ("shm", "tcp") if checks.BACKEND == "rustc10d" else ("auto",)
# Variants of a job besides the transports: "staged" stages every CPU tensor the way CUDA
# tensors are staged (copied in by the engine just before the op, copied back when it is done),
# host memory standing in for device memory, so the CUDA path's plumbing runs without a GPU.
# Its small piece size cuts every all_reduce and broadcast of more than a few elements into
# pieces (of 3000 bytes: not a whole number of complex128 elements, so the cut is rounded).
VARIANTS = {"staged": {"RUSTC10D_TEST_STAGING": "1", "RUSTC10D_STAGE_PIECE_BYTES": "3000"}}
JOB_VARIANTS = TRANSPORTS + (tuple(VARIANTS) if checks.BACKEND == "rustc10d" else ())
# Variants only some suites run (the differential one): "noarena" runs a one-host group's
# collectives without its shared arena (the rings, the direct exchange and single copy), as
# over shared memory where the arena is turned off.
EXTRA_VARIANTS = {"noarena": {"RUSTC10D_ARENA_SLOT_BYTES": "0"}}
# Variants that differ from the others only inside the Rust core (loopback TCP rather than
# shared memory, the rings rather than the arena): the same on every torch, so marked
# torch_independent (pytest.ini), and run on the first torch of scripts/torch-versions.txt only.
CORE_ONLY_VARIANTS = ("tcp", "noarena")


def transport_check_params(suite: str, extra_variants: tuple[str, ...] = ()) -> list:
    """check_params, once per transport and variant (and per extra variant, on rustc10d):
    (world, check name, transport or variant)."""
    variants = JOB_VARIANTS + (extra_variants if checks.BACKEND == "rustc10d" else ())
    core_only = [pytest.mark.torch_independent]
    return [pytest.param(*p.values, t, id=f"{t}-{p.id}" if t != "auto" else p.id,
                         marks=[*p.marks, *(core_only if t in CORE_ONLY_VARIANTS else [])])
            for t in variants for p in check_params(suite)]


def check_params(suite: str) -> list:
    """(world, check name) for every check of the suite, world-major so jobs run one by one;
    checks the backend under test cannot run are skipped here, without starting anything."""
    params = []
    for world in checks.WORLD_SIZES:
        for c in checks.CHECKS.values():
            if c.suite != suite or world not in c.worlds:
                continue
            reason = c.skip_reason(checks.BACKEND)
            marks = [pytest.mark.skip(reason=f"{checks.BACKEND}: {reason}")] if reason else []
            params.append(pytest.param(world, c.name, id=f"w{world}-{c.name}", marks=marks))
    return params


def job_params(suite: str) -> list:
    """(world, job) for every job that runs checks of the suite (none skipped)."""
    pairs = {(world, c.job): None for world in checks.WORLD_SIZES for c in checks.CHECKS.values()
             if c.suite == suite and world in c.worlds and not c.skip_reason(checks.BACKEND)}
    return [pytest.param(world, job, id=f"w{world}-{job}") for world, job in pairs]
