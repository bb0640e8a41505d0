"""The differential suite: generated torch.distributed calls (diff_calls.py), legal and
illegal, run by every rank of a job of their own (Check.job "differential", suite
"differential", tests/py/collectives/test_differential.py) and checked against plain arithmetic.

Settings (environment; pytest and the ranks read the same ones):
  RUSTC10D_DIFF_SEED   the seed (default 1). Call i is a function of (seed, world size, i).
  RUSTC10D_DIFF_CALLS  how many calls per job (default DEFAULT_CALLS, what CI runs).
  RUSTC10D_DIFF_ONLY   run only these calls: "137", "130-140" or "5,17,130-140" (replay).
  RUSTC10D_DIFF_FIRST_OP=1  make every mismatched call its fresh group's first op.

  RUSTC10D_DIFF_CALLS=5000 RUSTC10D_DIFF_SEED=7 .venv/bin/python -m pytest tests/py/collectives/test_differential.py --timeout 0

The calls are split into checks of CHUNK calls ("differential-00000-00049", ...), so a failure
is reported with the calls around it, and one bad chunk does not hide the others. A wrong
result is recorded (Ctx.errors) and the chunk goes on, since the other ranks would wait in the
next collective. Each failure names the seed, the call's index, its whole description and how
to replay it alone.

The calls run on the world group and on sub-groups made once per job (diff_calls.groups()). A
group that failed where it should not have (on any rank) is replaced with a fresh one of the
same ranks at the end of the chunk, by agreement over a Gloo group, so one broken group costs
one chunk, not the rest of the job. Mismatched calls make a group of their own each.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from checks import BACKEND, JOB_TIMEOUTS, WIDE_UNSIGNED, WORLD_SIZES, Ctx, new_group, register, wait_done
from diff_bad import local_call, mismatch_call, refused_locally
from diff_calls import Call, generate, groups
from diff_run import ISSUE, Env

DEFAULT_SEED = 1
DEFAULT_CALLS = 500  # per job (world size x variant): about 2 minutes for all twelve on 2 cores
CHUNK = 50
SEED = int(os.environ.get("RUSTC10D_DIFF_SEED", DEFAULT_SEED))
CALLS = int(os.environ.get("RUSTC10D_DIFF_CALLS", DEFAULT_CALLS))


def _parse_only(text: str) -> set[int]:
    only = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        only.update(range(int(lo), int(hi or lo) + 1))
    return only


ONLY = _parse_only(os.environ.get("RUSTC10D_DIFF_ONLY", ""))
# Every mismatch as its group's first op (normally 30 %): where a rank hung past the timeout.
ALL_FIRST_OP = os.environ.get("RUSTC10D_DIFF_FIRST_OP") == "1"
# Set by test_differential.py only: a job started again after a rank of the first one died
# (a panic aborts the process) runs the calls from this index on.
FROM = int(os.environ.get("RUSTC10D_DIFF_FROM", "0"))
# A job runs CALLS calls; the harness's default deadline fits the default count.
JOB_TIMEOUTS["differential"] = max(300, 60 + 0.6 * CALLS)


def variant() -> str:
    """The job variant this rank runs in (harness.VARIANTS), for the replay line."""
    if os.environ.get("RUSTC10D_TEST_STAGING") == "1":
        return "staged"
    if os.environ.get("RUSTC10D_ARENA_SLOT_BYTES") == "0":
        return "noarena"
    return os.environ.get("RUSTC10D_TRANSPORT", "auto")


def gloo_skip(call: Call) -> str | None:
    """Why Gloo cannot run this call (checks.gloo_gaps and more), else None."""
    if call.kind != "good":
        return "the refusals and mismatch errors checked are rustc10d's"
    if call.dtype in (torch.int16,) + WIDE_UNSIGNED and call.op not in P2P_OPS:
        return f"Gloo has no {call.dtype} collectives (its point-to-point ops move any bytes)"
    if call.reduce_op == "PREMUL_SUM":
        return "Gloo has no PREMUL_SUM"
    if call.dtype == torch.bool and call.reduce_op in ("SUM", "AVG"):
        return "Gloo adds bool bytes (stores 2)"
    if call.values == "special" and call.reduce_op in ("MIN", "MAX"):
        return "Gloo's MIN and MAX do not propagate NaN"
    if call.op == "all_to_all" and call.param("split") != "even":
        return "Gloo's all_to_all needs equal tensor sizes"
    if call.op == "sparse_all_reduce" and call.dtype in (torch.float16, torch.bool):
        return "Gloo's sparse all_reduce has no float16 or bool (cadd_sparse)"
    if call.layout == "strided" and call.op in ("all_reduce", "broadcast", "reduce", "scatter", "reduce_scatter"):
        return "Gloo writes a gapped view's result as if it were contiguous, over the gaps"
    if call.layout in NOT_CONTIGUOUS and call.op in P2P_OPS + ("all_to_all_single",):
        return "Gloo's point-to-point and all_to_all_single need contiguous tensors"
    if call.op == "send_recv" and call.param("how") == "recv_any" and 0 in call.shape:
        return "Gloo never matches an empty message with a receive from any source (the send times out)"
    if call.op in ("gather", "reduce", "reduce_scatter", "reduce_scatter_tensor") and call.dtype.is_complex:
        return f"torch passes {call.op}'s complex tensors on as complex, and Gloo has no complex"
    if call.param("form") == "stack":
        return "Gloo's *_into_tensor / *_tensor need the blocks concatenated along dim 0"
    return None


NOT_CONTIGUOUS = ("transposed", "strided", "channels_last")
P2P_OPS = ("send_recv", "isend_irecv", "batch_isend_irecv")


class Groups:
    """The job's groups by name (None: the default group), made once, the same way on every
    rank; and a Gloo group over every rank on which ranks agree which groups to replace."""

    def __init__(self, world: int):
        self.world = world
        self.pgs = {name: None if name == "world" else new_group(list(ranks))
                    for name, ranks in groups(world).items()}
        self.agree = new_group(backend="gloo")

    def replace_broken(self, broken: set[str]) -> list[str]:
        """Every rank calls this at the same point; any group one rank saw fail is remade."""
        names = list(self.pgs)
        flags = torch.tensor([name in broken for name in names], dtype=torch.int32)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.agree)
        replaced = [name for name, f in zip(names, flags.tolist()) if f]
        for name in replaced:
            self.pgs[name] = new_group(list(groups(self.world)[name]))
        return replaced


_groups: Groups | None = None


class Runner:
    """Runs calls on this rank and records what went wrong in ctx.errors."""

    def __init__(self, ctx: Ctx, groups_: Groups):
        self.ctx, self.groups = ctx, groups_
        self.pending = []  # (env, handle, verify) of the calls in flight, in issue order
        self.broken: set[str] = set()

    def fail(self, call: Call, problems: list[str]):
        start = call.index // CHUNK * CHUNK
        test_id = f"w{call.world}-{chunk_name(start, min(CALLS, start + CHUNK))}"
        if variant() != "auto":
            test_id = f"{variant()}-{test_id}"
        calls = f"RUSTC10D_DIFF_CALLS={CALLS} " if CALLS != DEFAULT_CALLS else ""
        replay = (f"RUSTC10D_DIFF_SEED={call.seed} {calls}RUSTC10D_DIFF_ONLY={call.index} "
                  f".venv/bin/python -m pytest tests/py/collectives/test_differential.py -k '{test_id}'")
        lines = "\n".join(f"  {p}" for p in problems)
        self.ctx.errors.append(f"{call.describe()}\n  on rank {self.ctx.rank} ({variant()}):\n{lines}\n"
                               f"  replay: {replay}")

    def run(self, call: Call):
        if BACKEND == "gloo" and gloo_skip(call):
            return
        if call.kind == "mismatch":
            self.flush()
            self._mismatch(call)
            return
        if self.ctx.rank not in call.ranks:
            return
        env = Env(self.ctx.rank, call, self.groups.pgs[call.group])
        if call.kind == "local":
            self.flush()
            self._local(env)
            return
        try:
            handle, verify = ISSUE[call.op](env)
        except Exception:
            env.note(f"raised at issue: {_last_error()}")
            self._done(env)
            return
        self.pending.append((env, handle, verify))
        if not call.hold:
            self.flush()

    def flush(self):
        """Wait on every call in flight, newest first, and check each."""
        while self.pending:
            env, handle, verify = self.pending.pop()
            try:
                wait_done(handle, env.call.op)
                verify()
            except Exception:
                env.note(f"raised: {_last_error()}")
            env.check_untouched()
            self._done(env)

    def _done(self, env: Env):
        if env.problems:
            self.fail(env.call, env.problems)
            if any(p.startswith("raised") for p in env.problems):
                self.broken.add(env.call.group)

    def _local(self, env: Env):
        """An illegal call every rank that makes it must refuse at issue; then the group must
        still work."""
        try:
            bad = local_call(env)
        except Exception:
            env.note(f"the test could not build the call: {_last_error()}")
            bad = None
        if bad is not None and bad.fn is not None:
            exc = None
            try:
                bad.fn()
            except Exception as e:  # noqa: BLE001 (what it raised is the point)
                exc = e
            env.note(refused_locally(exc))
            for p in bad.changed():
                env.note(f"{p} (by a call refused at issue)")
        try:
            probe = torch.ones(3)
            dist.all_reduce(probe, group=env.pg)
            if probe.tolist() != [float(env.n)] * 3:
                env.note(f"the group is not usable after it: an all_reduce of ones gave {probe.tolist()}")
        except Exception:
            env.note(f"raised: the group is not usable after it: {_last_error()}")
        self._done(env)

    def _mismatch(self, call: Call):
        """Ranks that call differently on a fresh group: every member raises "does not
        match", no tensor changes; the group is then destroyed. Mostly after a matching call
        on the group; with "first_op", as its first op, while slower members may still be
        joining it: then any error will do (one may come from new_group itself, or name a peer
        that gave up), but every member must raise, within the group's timeout."""
        first_op = call.param("first_op", False) or ALL_FIRST_OP
        member = self.ctx.rank in call.ranks
        try:
            pg = new_group(list(call.ranks))
        except RuntimeError as e:
            if not (member and first_op):
                self.fail(call, [f"raised: new_group raised: {_last_error()}"])
            elif BACKEND == "rustc10d" and "rustc10d" not in str(e):
                self.fail(call, [f"new_group raised an error that does not name rustc10d: {e}"])
            return
        if not member:
            return
        env = Env(self.ctx.rank, call, pg)
        bad = mismatch_call(env)
        if not first_op:
            # first a call that matches, so that every member has joined the group
            try:
                dist.all_reduce(torch.ones(1), group=pg)
            except Exception:
                env.note(f"raised: a matching all_reduce on the fresh group failed: {_last_error()}")
        if not env.problems:
            try:
                bad.fn()
                env.note("it did not raise (expected a mismatch error on every rank)")
            except RuntimeError as e:
                if not first_op and "does not match" not in str(e):
                    env.note(f"expected an error naming \"does not match\", got {type(e).__name__}: {e}")
            for p in bad.changed():
                env.note(f"{p} (by a mismatched call)")
        try:
            dist.destroy_process_group(pg)
        except Exception:
            env.note(f"destroying the mismatched group raised: {_last_error()}")
        if env.problems:
            self.fail(call, env.problems)


def _last_error() -> str:
    return traceback.format_exc(limit=-2).strip().replace("\n", "\n    ")


def current_call_path(folder, rank: int) -> Path:
    """Where a rank notes the call it is about to make: a rank that crashes (a panic aborts
    the process) cannot record its failure, but the test reads this back."""
    return Path(folder) / f"differential-current-rank{rank}.txt"


def run_chunk(ctx: Ctx, start: int, stop: int):
    global _groups
    if _groups is None:  # the first chunk this job runs, on every rank
        _groups = Groups(ctx.world)
    runner = Runner(ctx, _groups)
    note = current_call_path(ctx.scratch or ".", ctx.rank)
    for index in range(start, stop):
        if index < FROM or (ONLY and index not in ONLY):
            continue
        call = generate(SEED, ctx.world, index)
        note.write_text(call.describe())
        try:
            runner.run(call)
        except Exception:  # a bug of the suite's own, not the backend's: name the call anyway
            runner.fail(generate(SEED, ctx.world, index), [f"the test itself raised: {_last_error()}"])
    runner.flush()
    replaced = _groups.replace_broken(runner.broken)
    if replaced:
        ctx.errors.append(f"groups {replaced} failed in this chunk and were replaced for the next ones")


def chunk_name(start: int, stop: int) -> str:
    return f"differential-{start:05d}-{stop - 1:05d}"


def chunk_start(name: str) -> int:
    return int(name.split("-")[1])


for _start in range(0, CALLS, CHUNK):
    _stop = min(CALLS, _start + CHUNK)
    register("differential", chunk_name(_start, _stop),
             lambda ctx, start=_start, stop=_stop: run_chunk(ctx, start, stop),
             worlds=WORLD_SIZES, job="differential")
