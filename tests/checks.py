"""The checks that every rank of a test job runs (see worker.py), and their registry.

This module holds the registry, inputs, comparisons, the ops under test (*_case) and the checks
of all_reduce, broadcast and p2p; checks_ops.py holds those of every other op, and
checks_stacks.py those of DDP, FSDP2 & co. Importing this module registers them all. pytest
imports it too, to parametrize the tests at collection time, so the list of checks is static
and the same on both sides. Most checks run in one "main" job per world size; each stack runs
in a job of its own (Check.job). A check is a function of a Ctx, run by all ranks
of the job at the same time. It fails by raising, or by recording wrong data through
ctx.expect_*() and carrying on (see Ctx.errors). Inputs come from a seed derived from (check,
rank, shape), so every rank can build every other rank's input and compute the expected result
locally with plain torch arithmetic.

The backend under test is RUSTC10D_TEST_BACKEND (default "rustc10d"); "gloo" runs the same
checks against Gloo to validate the checks themselves, skipping what Gloo cannot do.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import os
import threading
import time
import zlib
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

BACKEND = os.environ.get("RUSTC10D_TEST_BACKEND", "rustc10d")
WORLD_SIZES = (2, 3, 4)
# The timeout of the jobs' default group and of every group the checks create (torch's default
# for a new group is 30 minutes): a broken collective must fail its check, not hang the job.
GROUP_TIMEOUT = timedelta(seconds=30)

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
DTYPES = FLOAT_DTYPES + INT_DTYPES + (torch.bool,)
# torch implements few operations for these (no randint, no min or max, no eq on some
# releases): they are drawn, reduced and compared as the signed type of their width, same bits.
WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
SIGNED_OF = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}
ARITH_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
BITWISE_OPS = ("BAND", "BOR", "BXOR")
# PREMUL_SUM multiplies every input by this factor before summing (dist._make_nccl_premul_sum);
# not a power of two, so a backend that drops the factor, or applies it twice, shows up.
PREMUL_FACTOR = 0.3

MEDIUM = (100_003,)  # prime: crosses small chunk sizes for every dtype, never divides evenly
LARGE = (2**21 + 3,)  # 8 MiB of float32, divisible by neither 2, 3 nor 4: chunking


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def supported_ops(dtype: torch.dtype) -> tuple[str, ...]:
    if dtype.is_floating_point:
        return ARITH_OPS + ("PREMUL_SUM",)
    return ARITH_OPS[:-1] + BITWISE_OPS  # an integer AVG has no integer result


def rejected_ops(dtype: torch.dtype) -> tuple[str, ...]:
    return tuple(op for op in ARITH_OPS + BITWISE_OPS if op not in supported_ops(dtype))


# ----------------------------------------------------------------------------- registry


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    suite: str  # the test module that reports it: "init", "collectives" or "p2p"
    fn: Callable[[Ctx], None]
    worlds: tuple[int, ...]
    skip_on: dict[str, str]  # backend -> why this check cannot run there
    job: str = "main"  # the job that runs it: "main" (one per world size), or a job of its own
    last: bool = False  # runs after every other check of its job (it may leave the group broken)

    def skip_reason(self, backend: str) -> str | None:
        return self.skip_on.get(backend)


# Insertion order is run order (but `last` checks after all others): every rank of a job runs
# the checks in this order.
CHECKS: dict[str, Check] = {}
# Jobs that need longer than harness.JOB_TIMEOUT: job name -> seconds.
JOB_TIMEOUTS: dict[str, float] = {}


def register(suite, name, fn, worlds=WORLD_SIZES, skip_on=None, job="main", last=False):
    assert name not in CHECKS, name
    CHECKS[name] = Check(name, suite, fn, tuple(worlds), dict(skip_on or {}), job, last)


def check(suite, worlds=WORLD_SIZES, skip_on=None, job="main", last=False):
    """Decorator form of register(), named after the function."""

    def deco(fn):
        register(suite, fn.__name__, fn, worlds, skip_on, job, last)
        return fn

    return deco


# A developer's shortcut: RUSTC10D_TEST_ONLY=name,name runs only those checks in each job (with
# pytest -k selecting the same ones), instead of every check of the job.
ONLY = {name for name in os.environ.get("RUSTC10D_TEST_ONLY", "").split(",") if name}


def runnable(world: int, backend: str, job: str = "main") -> list[Check]:
    found = [c for c in CHECKS.values() if c.job == job and world in c.worlds and not c.skip_reason(backend)
             and (not ONLY or c.name in ONLY)]
    return sorted(found, key=lambda c: c.last)  # stable: insertion order otherwise


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class Ctx:
    rank: int
    world: int
    backend: str
    check: str = ""
    scratch: str = ""  # a folder every rank of the job shares (the job's results folder)
    # Wrong results are recorded here, not raised: the check goes on issuing the same ops as
    # the other ranks, so one rank's bad data does not leave the others waiting in a collective.
    errors: list[str] = dataclasses.field(default_factory=list)

    def expect_reduced(self, got, inputs, op, where):
        self._note(reduced_mismatch(got, inputs, op, where))

    def expect_equal(self, got, expected, where):
        self._note(equal_mismatch(got, expected, where))

    def expect_close(self, got, expected, where, rtol, atol):
        self._note(close_mismatch(got, expected, where, rtol, atol))

    def _note(self, error: str | None):
        if error:
            self.errors.append(error)

    def input(self, rank, shape, dtype, op="", salt="") -> torch.Tensor:
        """`rank`'s deterministic input for this check (any rank can build any rank's)."""
        return make_input(f"{self.check}|{salt}|{rank}", shape, dtype, op)

    def inputs(self, shape, dtype, op="", salt="", ranks=None) -> list[torch.Tensor]:
        """input() of each of `ranks` (default: every rank), in that order."""
        return [self.input(r, shape, dtype, op, salt) for r in (range(self.world) if ranks is None else ranks)]

    def garbage(self, shape, dtype) -> torch.Tensor:
        """An output buffer's initial contents: random, so an output left unwritten shows."""
        return make_input(f"{self.check}|garbage|{self.rank}", shape, dtype)

    def shapes(self, dtype, large=None, scalar=True) -> list[tuple[int, ...]]:
        # 0-dim (a loss scalar), empty, 1, W-1, odd, N-d, and sizes that fit no even split;
        # LARGE (chunked transfers) by default for float32 only, to keep the run short.
        # `scalar=False` for ops that concatenate or split along dim 0.
        shapes = [(), (0,), (1,), (self.world - 1,), (7,), (7, 11, 13), MEDIUM]
        if large is None:
            large = dtype == torch.float32
        if large:
            shapes.append(LARGE)
        return list(dict.fromkeys(s for s in shapes if scalar or s != ()))

    @property
    def peer(self) -> int:
        """The partner in two-rank checks."""
        return 1 - self.rank


def make_input(key: str, shape, dtype, op="") -> torch.Tensor:
    # crc32, not hash(): Python salts str hashes per process, and ranks must agree
    if dtype.is_complex:  # torch hands complex tensors to backends as (real, imag) pairs
        return torch.view_as_complex(make_input(key, (*shape, 2), dtype.to_real(), op))
    if dtype in WIDE_UNSIGNED:  # (their reductions wrap, and are checked bit for bit)
        return make_input(key, shape, SIGNED_OF[dtype], op).view(dtype)
    g = torch.Generator().manual_seed(zlib.crc32(f"{key}|{shape}|{dtype}|{op}".encode()))
    if dtype == torch.bool:
        # mostly True where the op is an AND, mostly False where it is an OR: results vary
        p_true = {"PRODUCT": 0.8, "MIN": 0.8, "BAND": 0.8, "SUM": 0.2, "MAX": 0.2, "BOR": 0.2}
        return torch.rand(shape, generator=g) < p_true.get(op, 0.5)
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g, dtype=torch.float64) * 4 - 2).to(dtype)
    lo, hi = _int_range(dtype, op)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype)


def _int_range(dtype, op) -> tuple[int, int]:
    """[lo, hi) such that reducing over up to max(WORLD_SIZES) ranks cannot overflow:
    wrap-around is not what these checks are about."""
    info, n = torch.iinfo(dtype), max(WORLD_SIZES)
    if op in ("SUM", "AVG"):
        bound = info.max // n
    elif op == "PRODUCT":
        bound = int(info.max ** (1 / n))
        while bound**n > info.max:  # float root may round up
            bound -= 1
    else:  # MIN, MAX and bitwise ops use the whole range (catches 64 -> 32 bit truncation)
        return info.min, info.max
    return max(info.min, -bound), bound + 1


# ----------------------------------------------------------------------------- comparisons

_BITWISE_FN = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}


def reduce_unsigned(inputs: list[torch.Tensor], op: str, reduce) -> torch.Tensor:
    """The reduction of uint16/32/64 tensors by `reduce` (inputs, op) on the signed type of their
    width: SUM, PRODUCT and the bitwise ops wrap alike on the same bits, and unsigned order is
    signed order with the top bit flipped."""
    dtype = inputs[0].dtype
    signed = SIGNED_OF[dtype]
    flip = torch.iinfo(signed).min if op in ("MIN", "MAX") else 0
    return (reduce([t.view(signed) ^ flip for t in inputs], op) ^ flip).view(dtype)


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The exact reduction of all ranks' inputs: float64 for floating dtypes (compared with a
    tolerance), the input dtype otherwise (compared exactly)."""
    dtype = inputs[0].dtype
    if dtype in WIDE_UNSIGNED:
        return reduce_unsigned(inputs, op, reference)
    if op in _BITWISE_FN:
        return functools.reduce(_BITWISE_FN[op], inputs)
    stacked = torch.stack(inputs)
    if dtype == torch.bool:  # NCCL semantics: SUM/MAX are OR, PRODUCT/MIN are AND
        return stacked.any(0) if op in ("SUM", "MAX") else stacked.all(0)
    wide = stacked.to(torch.float64 if dtype.is_floating_point else torch.int64)
    fns = {"SUM": wide.sum, "PRODUCT": wide.prod, "MIN": wide.amin, "MAX": wide.amax}
    if op == "PREMUL_SUM":
        out = wide.sum(0) * PREMUL_FACTOR
    else:
        out = wide.mean(0) if op == "AVG" else fns[op](0)
    return out if dtype.is_floating_point else out.to(dtype)


def tolerance(dtype, world) -> dict:
    # rounding of W-1 additions (or multiplications) of values in [-2, 2), in any order
    eps = torch.finfo(dtype).eps
    return {"rtol": 4 * world * eps, "atol": 8 * world * eps}


def reduced_mismatch(got: torch.Tensor, inputs: list[torch.Tensor], op: str, where: str) -> str | None:
    if got.is_complex() and inputs[0].is_complex():  # reduced as pairs of reals (SUM, AVG, ...)
        return reduced_mismatch(torch.view_as_real(got), [torch.view_as_real(t) for t in inputs], op, where)
    dtype = inputs[0].dtype
    expected = reference(inputs, op)
    if not (dtype.is_floating_point and op in ("SUM", "PRODUCT", "AVG", "PREMUL_SUM")):
        return equal_mismatch(got, expected.to(dtype), where)
    if bad_meta := _meta_mismatch(got, inputs[0], where):
        return bad_meta
    tol = tolerance(dtype, len(inputs))
    close = torch.isclose(got.double(), expected, **tol)
    return None if bool(close.all()) else f"{where}: {differences(got, expected, ~close)} (tolerance {tol})"


def equal_mismatch(got: torch.Tensor, expected: torch.Tensor, where: str) -> str | None:
    if bad_meta := _meta_mismatch(got, expected, where):
        return bad_meta
    if got.dtype == torch.bool and got.numel():
        # a bool must be stored as 0/1: other bytes compare True but break later arithmetic
        top = int(got.contiguous().view(torch.uint8).max())
        if top > 1:
            return f"{where}: bool tensor stores byte {top}"
    if got.dtype in SIGNED_OF:
        got, expected = got.view(SIGNED_OF[got.dtype]), expected.view(SIGNED_OF[got.dtype])
    return None if torch.equal(got, expected) else f"{where}: {differences(got, expected, got != expected)}"


def close_mismatch(got, expected, where, rtol, atol) -> str | None:
    if bad_meta := _meta_mismatch(got, expected, where):
        return bad_meta
    close = torch.isclose(got, expected, rtol=rtol, atol=atol)
    return None if bool(close.all()) else f"{where}: {differences(got, expected, ~close)} (rtol {rtol}, atol {atol})"


def _meta_mismatch(got, expected, where) -> str | None:
    if got.dtype != expected.dtype:
        return f"{where}: dtype {got.dtype}, expected {expected.dtype}"
    if got.shape != expected.shape:
        return f"{where}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    return None


def differences(got, expected, bad) -> str:
    idx = bad.reshape(-1).nonzero().reshape(-1)[:5].tolist()
    g, e = got.reshape(-1), expected.reshape(-1)
    samples = ", ".join(f"[{i}] got {g[i].item()} expected {e[i].item()}" for i in idx)
    return f"{int(bad.sum())} of {got.numel()} elements differ: {samples}"


def expect_unsupported(ctx: Ctx, fn: Callable[[], object], what: str, phrase="not support"):
    """fn must raise RuntimeError; from rustc10d the message must name the backend and say
    what is unsupported (`phrase`, case-insensitive)."""
    try:
        fn()
    except RuntimeError as e:
        msg = str(e)
        if ctx.backend == "rustc10d":
            assert "rustc10d" in msg and phrase in msg.lower(), (
                f"{what}: error should name rustc10d and say {phrase!r}; got {msg!r}"
            )
        return
    raise AssertionError(f"{what}: expected RuntimeError, nothing was raised")


def new_group(ranks=None, **options):
    """dist.new_group() with GROUP_TIMEOUT; every rank must call it, members or not."""
    return dist.new_group(ranks, timeout=GROUP_TIMEOUT, **options)


def check_group_usable(ctx: Ctx, where: str):
    """An all_reduce still works (after an error, say)."""
    t = torch.ones(3)
    dist.all_reduce(t)
    ctx.expect_equal(t, torch.full((3,), float(ctx.world)), f"all_reduce {where}")


def _reduce_op(op: str):
    if op == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, op)


def gloo_gaps(dtype, op=None) -> dict[str, str]:
    """What Gloo lacks: skipped, not failed, when validating the checks against Gloo."""
    if dtype == torch.int16:
        return {"gloo": "Gloo has no int16 collectives"}
    if dtype == torch.bool and op == "SUM":
        return {"gloo": "Gloo adds bool bytes (stores 2)"}
    if op == "PREMUL_SUM":
        return {"gloo": "Gloo has no PREMUL_SUM"}
    return {}


# ----------------------------------------------------------------------------- ops under test
# Each *_case issues one op the way every rank of the job does, and returns (handle, verify):
# handle is what torch returned (a Work, a Future, a coalescing manager, a list of them, or None
# when the op was synchronous), and verify() records wrong output in the Ctx once the handle has
# been waited on (wait_done). Synchronous checks verify at once; the async checks issue many
# cases before they wait on any. Ranks are global; `group` defaults to the whole world.

Issued = tuple[object, Callable[[], None]]


def _where(op_name: str, dtype, shape, **params) -> str:
    return f"{op_name} {dtype_name(dtype)} {tuple(shape)}" + "".join(f", {k} {v}" for k, v in params.items())


def _members(ctx: Ctx, group) -> list[int]:
    return list(range(ctx.world)) if group is None else dist.get_process_group_ranks(group)


def _stacked(shape, n: int) -> tuple[int, ...]:
    """The shape of n tensors of `shape` concatenated along dim 0."""
    return (n * shape[0], *shape[1:])


def _expect_each(ctx: Ctx, got: list, expected: list, where: str):
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        ctx.expect_equal(g, e, f"{where}, [{i}]")


def work_exception(work) -> object | None:
    """work.exception(); the Python binding of torch 2.11 and 2.12 cannot return it (a TypeError
    for every backend), so there the only account of a Work's failure is is_success()."""
    try:
        return work.exception()
    except TypeError:
        return None if work.is_success() else "failed (is_success() is False)"


def wait_done(handle, what: str):
    """Wait on what an op returned; afterwards it must say it is done."""
    if handle is None:
        return
    if isinstance(handle, list):
        for h in handle:
            wait_done(h, what)
    elif isinstance(handle, torch._C.Future):  # from the *_coalesced ops
        handle.wait()
        assert handle.done(), f"{what}: Future not done after wait()"
    elif isinstance(handle, dist.distributed_c10d._CoalescingManager):
        handle.wait()
        wait_done(handle.works, what)
    else:
        handle.wait()
        # Gloo's reduce_scatter Works say is_completed() False even after wait(): let it pass there
        completed = handle.is_completed() or (BACKEND == "gloo" and handle.is_success())
        assert completed and handle.is_success(), f"{what}: Work not done after wait()"
        assert work_exception(handle) is None, f"{what}: {work_exception(handle)}"


def all_reduce_case(ctx, dtype, shape, op="SUM", async_op=False, salt="", group=None) -> Issued:
    members = _members(ctx, group)
    inputs = ctx.inputs(shape, dtype, op, salt, members)
    t = inputs[members.index(ctx.rank)].clone()
    work = dist.all_reduce(t, op=_reduce_op(op), group=group, async_op=async_op)
    return work, lambda: ctx.expect_reduced(t, inputs, op, _where("all_reduce", dtype, shape, op=op))


def broadcast_case(ctx, dtype, shape, root, async_op=False, salt="", group=None) -> Issued:
    salt = f"{salt}|from {root}"
    t = ctx.input(ctx.rank, shape, dtype, salt=salt)  # non-roots start with other data
    work = dist.broadcast(t, src=root, group=group, async_op=async_op)
    expected = ctx.input(root, shape, dtype, salt=salt)
    return work, lambda: ctx.expect_equal(t, expected, _where("broadcast", dtype, shape, root=root))


def reduce_case(ctx, dtype, shape, op="SUM", root=0, async_op=False, salt="") -> Issued:
    inputs = ctx.inputs(shape, dtype, op, salt)
    t = inputs[ctx.rank].clone()
    work = dist.reduce(t, dst=root, op=_reduce_op(op), async_op=async_op)

    def verify():
        if ctx.rank == root:  # what the other ranks' tensors hold afterwards is unspecified
            ctx.expect_reduced(t, inputs, op, _where("reduce", dtype, shape, op=op, root=root))

    return work, verify


def all_gather_case(ctx, dtype, shape, async_op=False, salt="") -> Issued:
    inputs = ctx.inputs(shape, dtype, salt=salt)
    outs = [ctx.garbage(shape, dtype) for _ in range(ctx.world)]
    work = dist.all_gather(outs, inputs[ctx.rank], async_op=async_op)
    return work, lambda: _expect_each(ctx, outs, inputs, _where("all_gather", dtype, shape))


def all_gather_into_tensor_case(ctx, dtype, shape, async_op=False, salt="", group=None) -> Issued:
    members = _members(ctx, group)
    inputs = ctx.inputs(shape, dtype, salt=salt, ranks=members)
    out = ctx.garbage(_stacked(shape, len(members)), dtype)
    work = dist.all_gather_into_tensor(out, inputs[members.index(ctx.rank)], group=group, async_op=async_op)
    return work, lambda: ctx.expect_equal(out, torch.cat(inputs), _where("all_gather_into_tensor", dtype, shape))


def all_gather_coalesced_case(ctx, dtype, shapes, async_op=False, salt="") -> Issued:
    inputs = [ctx.inputs(s, dtype, salt=f"{salt}|{i}") for i, s in enumerate(shapes)]  # [tensor][rank]
    outs = [[ctx.garbage(s, dtype) for s in shapes] for _ in range(ctx.world)]  # [rank][tensor]
    future = dist.all_gather_coalesced(outs, [per_rank[ctx.rank] for per_rank in inputs], async_op=async_op)

    def verify():
        for r in range(ctx.world):
            _expect_each(ctx, outs[r], [per_rank[r] for per_rank in inputs],
                         f"all_gather_coalesced {dtype_name(dtype)} {shapes}, from rank {r}")

    return future, verify


def gather_case(ctx, dtype, shape, root=0, async_op=False, salt="") -> Issued:
    inputs = ctx.inputs(shape, dtype, salt=salt)
    outs = [ctx.garbage(shape, dtype) for _ in range(ctx.world)] if ctx.rank == root else None
    work = dist.gather(inputs[ctx.rank], outs, dst=root, async_op=async_op)

    def verify():
        if ctx.rank == root:
            _expect_each(ctx, outs, inputs, _where("gather", dtype, shape, root=root))

    return work, verify


def gather_into_tensor_case(ctx, dtype, shape, root=0, async_op=False, salt="") -> Issued:
    inputs = ctx.inputs(shape, dtype, salt=salt)
    out = ctx.garbage(_stacked(shape, ctx.world), dtype) if ctx.rank == root else None
    work = dist.gather_into_tensor(inputs[ctx.rank], out, dst=root, async_op=async_op)

    def verify():
        if ctx.rank == root:
            ctx.expect_equal(out, torch.cat(inputs), _where("gather_into_tensor", dtype, shape, root=root))

    return work, verify


def scatter_case(ctx, dtype, shape, root=0, async_op=False, salt="") -> Issued:
    chunks = [ctx.input(root, shape, dtype, salt=f"{salt}|to {r}") for r in range(ctx.world)]
    out = ctx.garbage(shape, dtype)
    work = dist.scatter(out, chunks if ctx.rank == root else None, src=root, async_op=async_op)
    return work, lambda: ctx.expect_equal(out, chunks[ctx.rank], _where("scatter", dtype, shape, root=root))


def reduce_scatter_case(ctx, dtype, shape, op="SUM", async_op=False, salt="") -> Issued:
    """Each rank's list holds one tensor per destination rank."""
    mine = [ctx.input(ctx.rank, shape, dtype, op, salt=f"{salt}|to {r}") for r in range(ctx.world)]
    to_me = ctx.inputs(shape, dtype, op, salt=f"{salt}|to {ctx.rank}")
    out = ctx.garbage(shape, dtype)
    work = dist.reduce_scatter(out, mine, op=_reduce_op(op), async_op=async_op)
    return work, lambda: ctx.expect_reduced(out, to_me, op, _where("reduce_scatter", dtype, shape, op=op))


def reduce_scatter_tensor_case(ctx, dtype, shape, op="SUM", async_op=False, salt="", group=None) -> Issued:
    """`shape` is the output's; each rank's input is one such block per rank, concatenated."""
    members = _members(ctx, group)
    inputs = ctx.inputs(_stacked(shape, len(members)), dtype, op, salt, members)
    me = members.index(ctx.rank)
    out = ctx.garbage(shape, dtype)
    work = dist.reduce_scatter_tensor(out, inputs[me], op=_reduce_op(op), group=group, async_op=async_op)
    to_me = [t.reshape(len(members), *shape)[me] for t in inputs]
    return work, lambda: ctx.expect_reduced(out, to_me, op, _where("reduce_scatter_tensor", dtype, shape, op=op))


def _all_to_all_blocks(ctx, dtype, shape, uneven, salt):
    """(what this rank sends to each rank, what it must receive from each). Rank q sends rank r
    a block of shape[0] rows, or with `uneven` (q + 2r) % 3 times as many (zero for some)."""

    def block(src, dst):
        rows = shape[0] * ((src + 2 * dst) % 3 if uneven else 1)
        return ctx.input(src, (rows, *shape[1:]), dtype, salt=f"{salt}|to {dst}")

    return ([block(ctx.rank, r) for r in range(ctx.world)], [block(r, ctx.rank) for r in range(ctx.world)])


def all_to_all_single_case(ctx, dtype, shape, uneven=False, async_op=False, salt="") -> Issued:
    sends, expected = _all_to_all_blocks(ctx, dtype, shape, uneven, salt)
    out = ctx.garbage(torch.cat(expected).shape, dtype)
    splits = {}
    if uneven:
        splits = {"output_split_sizes": [len(t) for t in expected], "input_split_sizes": [len(t) for t in sends]}
    work = dist.all_to_all_single(out, torch.cat(sends), **splits, async_op=async_op)
    where = _where("all_to_all_single", dtype, shape, uneven=uneven)
    return work, lambda: ctx.expect_equal(out, torch.cat(expected), where)


def all_to_all_case(ctx, dtype, shape, uneven=False, async_op=False, salt="") -> Issued:
    sends, expected = _all_to_all_blocks(ctx, dtype, shape, uneven, salt)
    outs = [ctx.garbage(t.shape, dtype) for t in expected]
    work = dist.all_to_all(outs, sends, async_op=async_op)
    return work, lambda: _expect_each(ctx, outs, expected, _where("all_to_all", dtype, shape, uneven=uneven))


def all_reduce_coalesced_case(ctx, dtype, shapes, op="SUM", async_op=False, salt="") -> Issued:
    inputs = [ctx.inputs(s, dtype, op, f"{salt}|{i}") for i, s in enumerate(shapes)]
    ts = [per_rank[ctx.rank].clone() for per_rank in inputs]
    future = dist.all_reduce_coalesced(ts, op=_reduce_op(op), async_op=async_op)

    def verify():
        for t, per_rank in zip(ts, inputs):
            ctx.expect_reduced(t, per_rank, op, _where("all_reduce_coalesced", dtype, t.shape, op=op))

    return future, verify


def coalesced_case(ctx, dtype, shapes, inner, async_op=False, salt="", **params) -> Issued:
    """One `inner` case per shape, issued inside dist._coalescing_manager (torch turns
    all_reduce, all_gather_into_tensor and reduce_scatter_tensor there into one coalesced backend
    call)."""
    with dist._coalescing_manager(async_ops=async_op) as cm:
        issued = [inner(ctx, dtype, s, salt=f"{salt}|{i}", **params) for i, s in enumerate(shapes)]
    return (cm if async_op else None), lambda: [verify() for _, verify in issued]


def barrier_case(ctx, async_op=False) -> Issued:
    return dist.barrier(async_op=async_op), lambda: None


def ring_p2p_case(ctx, dtype, shape, salt="") -> Issued:
    """isend to the next rank, irecv from the previous one."""
    nxt, prv = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world
    buf = ctx.garbage(shape, dtype)
    works = [dist.isend(ctx.input(ctx.rank, shape, dtype, salt=salt), dst=nxt), dist.irecv(buf, src=prv)]
    return works, lambda: ctx.expect_equal(buf, ctx.input(prv, shape, dtype, salt=salt), _where("irecv", dtype, shape))


def sweep(ctx: Ctx, case, dtype, rooted=False, large=None, scalar=True, **params):
    """Run `case` synchronously for each of ctx.shapes(). With `rooted`, the root moves on by
    one rank with each shape, so every rank is the root for several shapes (at 7 shapes or
    more) without running every shape from every root."""
    for i, shape in enumerate(ctx.shapes(dtype, large, scalar)):
        _, verify = case(ctx, dtype, shape, **params, **({"root": i % ctx.world} if rooted else {}))
        verify()


# ============================================================================= suite "init"


@check("init")
def registration(ctx: Ctx):
    assert dist.get_backend() == ctx.backend, dist.get_backend()
    assert dist.is_backend_available(ctx.backend)
    assert "cpu" in dist.Backend.backend_capability.get(ctx.backend, []), (
        f"registered devices: {dist.Backend.backend_capability.get(ctx.backend)}"
    )
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    assert backend.name() == ctx.backend, f"Backend.name() is {backend.name()!r}"
    assert (backend.rank(), backend.size()) == (ctx.rank, ctx.world)


@check("init", skip_on={"gloo": "rustc10d's own counters"})
def per_op_stats(ctx: Ctx):
    """rustc10d.stats() counts what this group ran: ops, bytes, time, and copies (each
    rank at least copies the other ranks' contributions in once)."""
    import rustc10d

    zero = {"count": 0, "bytes": 0, "seconds": 0.0, "copied_bytes": 0, "wakeups": 0, "early_bytes": 0}
    before = rustc10d.stats().get("allreduce", zero)
    for _ in range(3):
        dist.all_reduce(torch.ones(256))
    after = rustc10d.stats()["allreduce"]
    assert after["count"] == before["count"] + 3, (before, after)
    assert after["bytes"] == before["bytes"] + 3 * 1024, (before, after)
    assert after["seconds"] > before["seconds"] and after["failed"] == before.get("failed", 0), (before, after)
    assert after["copied_bytes"] >= before["copied_bytes"] + 3 * 1024 * (ctx.world - 1), (before, after)
    assert after["wakeups"] >= before["wakeups"] and after["early_bytes"] >= before["early_bytes"], (before, after)


# ============================================================================= suite "collectives"


def _all_reduce_rejects(ctx: Ctx, dtype):
    for op in rejected_ops(dtype):
        t = torch.ones(5, dtype=dtype)
        expect_unsupported(ctx, lambda: dist.all_reduce(t, op=_reduce_op(op)), f"{op} on {dtype}")
    check_group_usable(ctx, "after the rejected ops")


def _strided_view(layout, dtype, rows, cols, salt):
    """(view, gaps): a non-contiguous (rows, cols) view into freshly filled storage, and a view
    of the storage between its elements (None when there is none)."""
    if layout == "gapped":  # every other column
        base = make_input(f"gapped|{salt}", (rows, 2 * cols), dtype)
        return base[:, ::2], base[:, 1::2]
    return make_input(f"transposed|{salt}", (cols, rows), dtype).t(), None


def _noncontiguous(ctx: Ctx, layout, dtype, op):
    """all_reduce and broadcast write the result into the caller's strided view, in place,
    and leave the storage between its elements alone."""
    for rows, cols in ((3, 5), (257, 389)):
        view, gaps = _strided_view(layout, dtype, rows, cols, ctx.rank)
        where = f"{layout} {rows}x{cols} view"
        gaps_before = None if gaps is None else gaps.clone()
        inputs = [ctx.input(r, (rows, cols), dtype, op) for r in range(ctx.world)]
        view.copy_(inputs[ctx.rank])
        dist.all_reduce(view, op=_reduce_op(op))
        ctx.expect_reduced(view, inputs, op, f"all_reduce into {where}")

        root = ctx.world - 1
        view.copy_(ctx.input(ctx.rank, (rows, cols), dtype, salt="bcast"))
        dist.broadcast(view, src=root)
        ctx.expect_equal(view, ctx.input(root, (rows, cols), dtype, salt="bcast"), f"broadcast into {where}")
        if gaps is not None:
            ctx.expect_equal(gaps, gaps_before, f"storage between the elements of the {where}")


for _dtype in DTYPES:
    _d = dtype_name(_dtype)
    for _op in supported_ops(_dtype):
        register("collectives", f"all_reduce-{_d}-{_op}",
                 functools.partial(sweep, case=all_reduce_case, dtype=_dtype, op=_op),
                 skip_on=gloo_gaps(_dtype, _op))
    register("collectives", f"all_reduce_rejects-{_d}",
             functools.partial(_all_reduce_rejects, dtype=_dtype), skip_on=gloo_gaps(_dtype))
for _dtype in DTYPES:
    register("collectives", f"broadcast-{dtype_name(_dtype)}",
             functools.partial(sweep, case=broadcast_case, dtype=_dtype, rooted=True), skip_on=gloo_gaps(_dtype))
for _layout in ("gapped", "transposed"):
    for _dtype, _op in ((torch.float32, "SUM"), (torch.bfloat16, "SUM"), (torch.int64, "SUM"),
                        (torch.uint8, "MAX"), (torch.bool, "MAX")):
        # Gloo reduces a gapped view as if it were contiguous, overwriting the gaps
        register("collectives", f"noncontiguous-{_layout}-{dtype_name(_dtype)}-{_op}",
                 functools.partial(_noncontiguous, layout=_layout, dtype=_dtype, op=_op),
                 skip_on={"gloo": "Gloo mishandles gapped views"} if _layout == "gapped" else {})


@check("collectives", skip_on={"gloo": "rustc10d's messages"})
def tensors_on_other_devices_are_refused(ctx: Ctx):
    """A tensor on a device rustc10d does not serve (meta here: CI has no GPU), or tensors of one
    op on different devices, raise a clear error; the group stays usable."""
    outputs = [torch.empty(3) for _ in range(ctx.world - 1)] + [torch.empty(3, device="meta")]
    expect_unsupported(ctx, lambda: dist.all_gather(outputs, torch.ones(3)), "an all_gather into a meta tensor",
                       phrase="meta")
    if torch.cuda.is_available():
        outputs = [torch.empty(3) for _ in range(ctx.world - 1)] + [torch.empty(3, device="cuda")]
        expect_unsupported(ctx, lambda: dist.all_gather(outputs, torch.ones(3)), "CPU and CUDA tensors in one op",
                           phrase="same device")
    check_group_usable(ctx, "after the refused devices")


@check("collectives", skip_on={"gloo": "rustc10d's transports"})
def transport_is_the_one_asked_for(ctx: Ctx):
    """After a message to and from every peer every peer is connected, through
    RUSTC10D_TRANSPORT's path: all ranks of a test job share this host, so shared memory unless
    TCP is forced. (Collectives may move nothing through connections: in the shared arena.)"""
    import rustc10d

    peers = [p for p in range(ctx.world) if p != ctx.rank]
    got = {p: torch.zeros(1) for p in peers}
    ops = [dist.P2POp(dist.isend, torch.full((1,), float(ctx.rank)), p) for p in peers]
    ops += [dist.P2POp(dist.irecv, got[p], p) for p in peers]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for p in peers:
        ctx.expect_equal(got[p], torch.full((1,), float(p)), f"message from rank {p}")
    want = "tcp" if os.environ.get("RUSTC10D_TRANSPORT") == "tcp" else "shm"
    links = rustc10d.links()
    assert links == {p: want for p in range(ctx.world) if p != ctx.rank}, (os.environ.get("RUSTC10D_TRANSPORT"), links)


@check("collectives", skip_on={"gloo": "rustc10d's counters"})
def broadcast_copies_each_byte_as_the_transport_says(ctx: Ctx):
    """Between processes of one host, a receiver reads a large broadcast straight from the root's
    memory: it copies each byte once and the root none (rustc10d.stats()'s copied_bytes; the
    call is checked with every rank in the shared arena, which copies nothing). Over TCP the
    root writes each byte to a socket and every rank but the last forwards it (the call checked
    with the one peer at 2 ranks, from 3 with every rank: 32 bytes each way per peer).
    A byte that arrived before its receive was posted counts once more (early_bytes)."""
    import rustc10d

    n = 1 << 20
    zero = {"copied_bytes": 0, "early_bytes": 0}
    before = rustc10d.stats().get("broadcast", zero)
    t = torch.full((n // 4,), float(ctx.rank))
    dist.broadcast(t, src=0)
    ctx.expect_equal(t, torch.zeros(n // 4), "broadcast")
    after = rustc10d.stats()["broadcast"]
    copied = after["copied_bytes"] - before["copied_bytes"] - (after["early_bytes"] - before["early_bytes"])
    if os.environ.get("RUSTC10D_TEST_STAGING") == "1":
        return  # staged in pieces of a few KiB: the ring, through the rings
    if os.environ.get("RUSTC10D_TRANSPORT") == "tcp":
        last = ctx.rank == ctx.world - 1
        want = 2 * 32 * (ctx.world - 1) + (n if ctx.rank == 0 or last else 2 * n)
    else:
        want = 0 if ctx.rank == 0 else n
    assert copied == want, (os.environ.get("RUSTC10D_TRANSPORT"), ctx.rank, before, after, want)


@check("collectives")
def async_ops_in_flight(ctx: Ctx):
    """Eight all_reduces issued before any is waited on; waited in reverse order."""
    specs = [
        (torch.float32, "SUM", (1001,)), (torch.float64, "MAX", (7,)),
        (torch.int64, "SUM", MEDIUM), (torch.int32, "MIN", (0,)),
        (torch.bfloat16, "SUM", (3, 5)), (torch.uint8, "BOR", (64,)),
        (torch.float32, "PRODUCT", (65_537,)), (torch.int8, "MAX", ()),
    ]
    pending = []
    for i, (dtype, op, shape) in enumerate(specs):
        inputs = [ctx.input(r, shape, dtype, op, salt=i) for r in range(ctx.world)]
        t = inputs[ctx.rank].clone()
        pending.append((i, t, inputs, op, dist.all_reduce(t, op=_reduce_op(op), async_op=True)))
    for i, t, inputs, op, work in reversed(pending):
        work.wait()
        assert work.is_completed() and work.is_success(), f"op {i}: Work not done after wait()"
        assert work_exception(work) is None, f"op {i}: {work_exception(work)}"
        ctx.expect_reduced(t, inputs, op, f"op {i} ({t.dtype} {op} {tuple(t.shape)})")


@check("collectives")
def sync_ops_run_after_the_async_ones_issued_before_them(ctx: Ctx):
    """rustc10d runs an op whose caller waits at once (async_op=False) on the caller's thread
    when nothing else is pending, else after what was issued before it: async all_reduces, then
    sync ones, a sync broadcast and barrier; every async op is done when the sync ones return."""
    pending = []
    for i in range(4):
        inputs = [ctx.input(r, (513 * (i + 1),), torch.float32, "SUM", salt=i) for r in range(ctx.world)]
        t = inputs[ctx.rank].clone()
        pending.append((i, t, inputs, dist.all_reduce(t, async_op=True)))
    inputs = [ctx.input(r, (100,), torch.int64, "SUM", salt="sync") for r in range(ctx.world)]
    t = inputs[ctx.rank].clone()
    dist.all_reduce(t)
    ctx.expect_reduced(t, inputs, "SUM", "the sync all_reduce after 4 async ones")
    b = torch.arange(10, dtype=torch.float64) if ctx.rank == ctx.world - 1 else torch.zeros(10, dtype=torch.float64)
    dist.broadcast(b, src=ctx.world - 1)
    ctx.expect_equal(b, torch.arange(10, dtype=torch.float64), "the sync broadcast")
    dist.barrier()
    for i, t, inputs, work in pending:
        assert work.is_completed(), f"async op {i} not done after the sync ops issued after it"
        work.wait()
        ctx.expect_reduced(t, inputs, "SUM", f"async op {i}")
    for i in range(3):  # back to back, as a tensor-parallel layer does them
        x = torch.full((16,), float(ctx.rank + i))
        dist.all_reduce(x)
        want = float(sum(range(ctx.world)) + ctx.world * i)
        assert x.tolist() == [want] * 16, f"back-to-back sync all_reduce {i}: {x.tolist()}"


@check("collectives", skip_on={"gloo": "rustc10d's own op"})
def the_direct_all_reduce_op_reduces_like_dist_all_reduce(ctx: Ctx):
    """rustc10d.all_reduce_ (torch.ops.rustc10d.all_reduce_), and the same bound to a group by
    rustc10d.all_reducer: every reduce op on several dtypes and shapes, contiguous and not (the
    latter through allreduce's way), on the world group and on a subgroup, after async ops still
    in flight; PREMUL_SUM and a Gloo group are refused with errors that say so, and the group
    goes on working."""
    import rustc10d
    specs = [(torch.float32, "SUM", (7,)), (torch.bfloat16, "SUM", (4096,)), (torch.float64, "AVG", (3, 5)),
             (torch.int64, "MAX", (1001,)), (torch.int32, "MIN", ()), (torch.uint8, "BOR", (64,)),
             (torch.float32, "PRODUCT", (33,)), (torch.float32, "SUM", (0,))]
    inputs = [ctx.input(r, (513,), torch.float32, "SUM", salt="async") for r in range(ctx.world)]
    pending = inputs[ctx.rank].clone()
    work = dist.all_reduce(pending, async_op=True)
    group = new_group()
    callers = {"all_reduce_": lambda t, op, g: rustc10d.all_reduce_(t, op, group=g),
               "all_reducer": lambda t, op, g: rustc10d.all_reducer(op, group=g)(t)}
    for i, (dtype, op, shape) in enumerate(specs):
        for where, g in (("world", None), ("subgroup", group)):
            for name, call in callers.items():
                ins = [ctx.input(r, shape, dtype, op, salt=f"{i}{where}{name}") for r in range(ctx.world)]
                t = ins[ctx.rank].clone()
                got = call(t, _reduce_op(op), g)
                assert got is t, f"{where}: {name} returns the tensor it was given"
                ctx.expect_reduced(t, ins, op, f"{name} {where} {dtype} {op} {shape}")
    assert work.is_completed(), "an async all_reduce issued before all_reduce_ is done when it returns"
    ctx.expect_reduced(pending, inputs, "SUM", "the async all_reduce before all_reduce_")
    ins = [ctx.input(r, (6, 4), torch.float32, "SUM", salt="strided") for r in range(ctx.world)]
    t = ins[ctx.rank].clone().t()  # not contiguous
    torch.ops.rustc10d.all_reduce_(t, dist.group.WORLD.group_name, 0)
    ctx.expect_reduced(t, [x.t() for x in ins], "SUM", "all_reduce_ of a transposed tensor, by the torch op")
    expect_unsupported(ctx, lambda: torch.ops.rustc10d.all_reduce_(torch.ones(3), dist.group.WORLD.group_name, 8),
                       "all_reduce_ with PREMUL_SUM", phrase="is not one of")
    reduce = rustc10d.all_reducer()
    t = ins[ctx.rank].clone().t()
    reduce(t)
    ctx.expect_reduced(t, [x.t() for x in ins], "SUM", "all_reducer's callable on a transposed tensor")
    expect_unsupported(ctx, lambda: rustc10d.all_reducer(dist.ReduceOp.PREMUL_SUM), "all_reducer with PREMUL_SUM",
                       phrase="is not one of")
    gloo = dist.new_group(backend="gloo")
    expect_unsupported(ctx, lambda: rustc10d.all_reduce_(torch.ones(3), group=gloo), "all_reduce_ on a Gloo group",
                       phrase="not rustc10d")
    expect_unsupported(ctx, lambda: rustc10d.all_reducer(group=gloo), "all_reducer on a Gloo group",
                       phrase="not rustc10d")
    dist.destroy_process_group(gloo)
    dist.destroy_process_group(group)
    check_group_usable(ctx, "after the direct op")


@check("collectives")
def python_threads_run_while_a_sync_op_waits(ctx: Ctx):
    """A sync op that waits for a late peer (on the caller's thread, where rustc10d runs it)
    lets the process's other Python threads run: the GIL is not held while it waits."""
    late = 0.6
    ticks, stop = [0], threading.Event()

    def tick():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.005)

    dist.barrier()
    counter = threading.Thread(target=tick, daemon=True)
    counter.start()
    try:
        if ctx.rank == 0:
            time.sleep(late)
        before = ticks[0]
        t0 = time.monotonic()
        x = torch.ones(4)
        dist.all_reduce(x)
        waited, during = time.monotonic() - t0, ticks[0] - before
    finally:
        stop.set()
        counter.join(timeout=5)
    assert x.tolist() == [float(ctx.world)] * 4, x.tolist()
    if ctx.rank != 0:
        assert waited > late / 2, f"all_reduce returned after {waited:.2f} s, before rank 0 arrived"
        assert during >= 10, f"another Python thread ran {during} times in the {waited:.2f} s the op waited"


@check("collectives")
def future_holds_result(ctx: Ctx):
    inputs = [ctx.input(r, (1001,), torch.float64, "SUM") for r in range(ctx.world)]
    t = inputs[ctx.rank].clone()
    result = dist.all_reduce(t, async_op=True).get_future().wait()
    assert isinstance(result, list) and len(result) == 1, f"future value {result!r}"
    ctx.expect_reduced(result[0], inputs, "SUM", "future value [0]")
    ctx.expect_equal(t, result[0], "the tensor passed in vs. the future value")


@check("collectives")
def barrier_waits_for_all(ctx: Ctx):
    for _ in range(3):  # several in a row must not run ahead of each other
        late = 0.5
        if ctx.rank == 0:
            time.sleep(late)
        t0 = time.monotonic()
        dist.barrier()
        waited = time.monotonic() - t0
        if ctx.rank != 0:
            assert waited > late / 2, f"barrier returned after {waited:.2f} s, before rank 0 arrived"


@check("collectives")
def unsupported_dtype_is_rejected(ctx: Ctx):
    """A dtype outside the supported set, which torch hands to the backend without complaint
    (float8), is refused with a RuntimeError rather than reduced as something else."""
    t = torch.ones(4).to(torch.float8_e4m3fn)
    expect_unsupported(ctx, lambda: dist.all_reduce(t), "all_reduce of a float8_e4m3fn tensor")
    check_group_usable(ctx, "after the rejected op")


# ============================================================================= suite "p2p"


def _p2p_ring(ctx: Ctx, dtype):
    """Each rank sends to the next and receives from the previous, every shape."""
    nxt, prv = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world
    for shape in ctx.shapes(dtype):
        buf = torch.zeros(shape, dtype=dtype)
        send = dist.isend(ctx.input(ctx.rank, shape, dtype), dst=nxt)
        src = dist.recv(buf, src=prv)
        send.wait()
        assert src == prv, f"recv returned sender {src}, expected {prv}"
        ctx.expect_equal(buf, ctx.input(prv, shape, dtype), f"shape {shape} from rank {prv}")


for _dtype in DTYPES:
    register("p2p", f"send_recv_ring-{dtype_name(_dtype)}", functools.partial(_p2p_ring, dtype=_dtype))


@check("p2p", worlds=(2,))
def irecv_pending_until_sent(ctx: Ctx):
    """(a) A posted irecv is not complete until the data arrives; then it says so."""
    late = 1.5
    payload = ctx.input(1, (1001,), torch.float32)
    if ctx.rank == 1:
        time.sleep(late)
        dist.send(payload, dst=0, tag=11)
        return
    buf = torch.zeros_like(payload)
    work = dist.irecv(buf, src=1, tag=11)
    t0 = time.monotonic()
    done = work.is_completed()
    poll_s = time.monotonic() - t0
    assert not done, "irecv Work says completed before rank 1 sent anything"
    assert poll_s < 0.1, f"is_completed() blocked for {poll_s:.2f} s"
    work.wait()
    waited = time.monotonic() - t0
    assert waited > late / 3, f"wait() returned after {waited:.2f} s, before rank 1 sent"
    assert work.is_completed() and work.is_success(), "Work not done after wait()"
    assert work_exception(work) is None, work_exception(work)
    assert work.source_rank() == 1, f"source_rank() {work.source_rank()}"
    ctx.expect_equal(buf, payload, "received data")


def _issued_by_callback(fut, issue, what: str):
    """Register `issue` as a callback of `fut` and return the Work it issued, waited for: a
    callback that the backend runs while it holds one of its own locks and that issues an op
    needing that lock would never come back (the I/O thread, with every op, stuck for good)."""
    issued = []
    fut.then(lambda _: issued.append(issue()))
    deadline = time.monotonic() + 10
    while not issued and time.monotonic() < deadline:
        time.sleep(0.01)
    assert issued, f"the {what} issued from a completion callback never came back (a deadlock?)"
    assert issued[0].wait(timeout=timedelta(seconds=10)), f"the {what} issued from a callback did not finish"


@check("p2p", worlds=(2,))
def a_completion_callback_can_issue_the_next_op(ctx: Ctx):
    """A Future callback of an irecv (or an isend) issues the next one. Torch runs such
    callbacks in the thread that completes the future: here the backend's own, which must not
    hold a lock of its mailbox or connection then (it did: a receive completed from a reader
    thread under its mailbox's lock, and the irecv posted from the callback wanted it again)."""
    first, second = ctx.input(0, (1001,), torch.float32), ctx.input(1, LARGE, torch.float32)
    if ctx.rank == 1:
        time.sleep(0.3)  # rank 0's irecvs are posted first, so that what arrives completes them
        # 7 elements where rank 0 expects 5: the reader fails that receive as the header arrives
        dist.send(torch.ones(7), dst=0, tag=35)
        dist.send(first, dst=0, tag=36)
        big = dist.isend(second, dst=0, tag=33)  # still in flight when its callback is added
        _issued_by_callback(big.get_future(), lambda: dist.isend(first, dst=0, tag=34), "isend")
        dist.send(first, dst=0, tag=31)
        dist.send(second, dst=0, tag=32)
        return
    wrong, after_wrong = torch.zeros(5), torch.zeros_like(first)
    failed = dist.irecv(wrong, src=1, tag=35)
    _issued_by_callback(failed.get_future(), lambda: dist.irecv(after_wrong, src=1, tag=36),
                        "irecv after a failed one")
    ctx.expect_equal(after_wrong, first, "the message after the mismatched one")
    assert work_exception(failed) is not None, "a receive of 5 elements took a message of 7"
    a, b = torch.zeros_like(first), torch.zeros_like(second)
    big = torch.zeros_like(second)
    work = dist.irecv(a, src=1, tag=31)
    big_work = dist.irecv(big, src=1, tag=33)
    c = torch.zeros_like(first)
    _issued_by_callback(big_work.get_future(), lambda: dist.irecv(c, src=1, tag=34), "irecv")
    _issued_by_callback(work.get_future(), lambda: dist.irecv(b, src=1, tag=32), "irecv")
    for got, want, what in ((a, first, "first"), (b, second, "second"), (big, second, "large"), (c, first, "third")):
        ctx.expect_equal(got, want, f"the {what} message")


@check("p2p", worlds=(2,), skip_on={"gloo": "Gloo cancels an isend whose Work is dropped"})
def dropped_isend_still_delivers(ctx: Ctx):
    """(b) Neither the Work nor the tensor of an isend is kept by the caller: the engine must."""
    if ctx.rank == 0:
        dist.isend(ctx.input(0, LARGE, torch.float32), dst=1, tag=21)
        gc.collect()
        # reuse freed memory, so a send buffer that was freed too early shows up as wrong data
        scratch = [torch.full(LARGE, -1.0) for _ in range(4)]
        del scratch
    else:
        time.sleep(0.5)  # the send stays in flight, unreferenced, for a while
        buf = torch.zeros(LARGE)
        dist.recv(buf, src=0, tag=21)
        ctx.expect_equal(buf, ctx.input(0, LARGE, torch.float32), "received data")


@check("p2p", worlds=(2,))
def tagged_p2p_any_order(ctx: Ctx):
    """(e) Several isends/irecvs outstanding at once, posted in different orders on each side,
    match by (peer, tag); messages with the same tag arrive in the order sent. Rank 1 posts its
    receives late, so rank 0's messages arrive before their receives exist, while rank 0's
    receives exist before rank 1's messages arrive."""
    recv_tags = {0: [5, 1, 2, 3, 5], 1: [3, 5, 1, 5, 2]}[ctx.rank]
    send_tags = {0: [2, 5, 3, 1, 5], 1: [5, 1, 3, 5, 2]}[ctx.rank]

    def payload(sender, tag, nth):  # nth: how many earlier messages carried this tag
        return torch.full((9,), 1000 * sender + 10 * tag + nth, dtype=torch.int64)

    if ctx.rank == 1:
        time.sleep(0.3)
    recvs = []
    for i, tag in enumerate(recv_tags):
        nth = recv_tags[:i].count(tag)
        buf = torch.zeros(9, dtype=torch.int64)
        recvs.append((tag, nth, buf, dist.irecv(buf, src=ctx.peer, tag=tag)))
    sends = []
    for i, tag in enumerate(send_tags):
        nth = send_tags[:i].count(tag)
        sends.append(dist.isend(payload(ctx.rank, tag, nth), dst=ctx.peer, tag=tag))
    for work in sends:
        work.wait()
    for tag, nth, buf, work in recvs:
        work.wait()
        ctx.expect_equal(buf, payload(ctx.peer, tag, nth), f"message {nth} with tag {tag}")


@check("p2p", worlds=(2,))
def recv_source_rank(ctx: Ctx):
    """(f) The sender of a receive is reported, by source_rank() and by dist.recv()."""
    send = dist.isend(torch.full((4,), float(ctx.rank)), dst=ctx.peer, tag=31)
    buf = torch.zeros(4)
    work = dist.irecv(buf, src=ctx.peer, tag=31)
    work.wait()
    assert work.source_rank() == ctx.peer, f"source_rank() {work.source_rank()}, sender {ctx.peer}"
    send.wait()
    send = dist.isend(torch.ones(4), dst=ctx.peer, tag=32)
    assert dist.recv(buf, src=ctx.peer, tag=32) == ctx.peer
    send.wait()


# These two run after every other check (last=True), in this order: Gloo closes the connection on
# a receive timeout, so nothing may use the group after it there. A receive for this tag is never
# sent, by any check.
NEVER_SENT_TAG = 999


@check("p2p", worlds=(2,), last=True)
def recv_wait_timeout_raises(ctx: Ctx):
    """(c) wait(timeout) on a receive nobody sends raises once the timeout expires."""
    work = dist.irecv(torch.zeros(4), src=ctx.peer, tag=NEVER_SENT_TAG)
    t0 = time.monotonic()
    try:
        work.wait(timeout=timedelta(seconds=1))
    except RuntimeError:
        waited = time.monotonic() - t0
        assert 0.5 <= waited <= 5, f"wait(timeout=1 s) raised after {waited:.2f} s"
        return
    raise AssertionError("wait(timeout=1 s) returned for a receive nobody sends")


@check("p2p", worlds=(2,), skip_on={"gloo": "Gloo tears the connection down on a recv timeout"}, last=True)
def usable_after_wait_timeout(ctx: Ctx):
    """A wait() that timed out is the caller's choice, not a broken group."""
    check_group_usable(ctx, "after a wait(timeout) expired")
    send = dist.isend(torch.full((3,), 7.0), dst=ctx.peer, tag=41)
    buf = torch.zeros(3)
    dist.recv(buf, src=ctx.peer, tag=41)
    send.wait()
    ctx.expect_equal(buf, torch.full((3,), 7.0), "p2p after a wait(timeout) expired")


# The other checks live in their own modules, which register them on import (they import this
# one, which is complete by now).
import checks_ops  # noqa: E402,F401
import checks_regressions  # noqa: E402,F401
import checks_stacks  # noqa: E402,F401
import checks_differential  # noqa: E402,F401
