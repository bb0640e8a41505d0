"""The checks that every rank of a test job runs (see worker.py), and their registry.

pytest imports this module too, to parametrize the tests at collection time, so the list of
checks is static and the same on both sides. A check is a function of a Ctx, run by all ranks
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
import time
import zlib
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

BACKEND = os.environ.get("RUSTC10D_TEST_BACKEND", "rustc10d")
WORLD_SIZES = (2, 3, 4)

FLOAT_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
DTYPES = FLOAT_DTYPES + INT_DTYPES + (torch.bool,)
ARITH_OPS = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
BITWISE_OPS = ("BAND", "BOR", "BXOR")

MEDIUM = (100_003,)  # prime: crosses small chunk sizes for every dtype, never divides evenly
LARGE = (2**21 + 3,)  # 8 MiB of float32, divisible by neither 2, 3 nor 4: chunking


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def supported_ops(dtype: torch.dtype) -> tuple[str, ...]:
    if dtype.is_floating_point:
        return ARITH_OPS
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

    def skip_reason(self, backend: str) -> str | None:
        return self.skip_on.get(backend)


# Insertion order is run order: every rank of a job runs the checks in this order.
CHECKS: dict[str, Check] = {}


def register(suite, name, fn, worlds=WORLD_SIZES, skip_on=None):
    assert name not in CHECKS, name
    CHECKS[name] = Check(name, suite, fn, tuple(worlds), dict(skip_on or {}))


def check(suite, worlds=WORLD_SIZES, skip_on=None):
    """Decorator form of register(), named after the function."""

    def deco(fn):
        register(suite, fn.__name__, fn, worlds, skip_on)
        return fn

    return deco


def runnable(world: int, backend: str) -> list[Check]:
    return [c for c in CHECKS.values() if world in c.worlds and not c.skip_reason(backend)]


# ----------------------------------------------------------------------------- inputs


@dataclasses.dataclass(frozen=True)
class Ctx:
    rank: int
    world: int
    backend: str
    check: str = ""
    # Wrong results are recorded here, not raised: the check goes on issuing the same ops as
    # the other ranks, so one rank's bad data does not leave the others waiting in a collective.
    errors: list[str] = dataclasses.field(default_factory=list)

    def expect_reduced(self, got, inputs, op, where):
        self._note(reduced_mismatch(got, inputs, op, where))

    def expect_equal(self, got, expected, where):
        self._note(equal_mismatch(got, expected, where))

    def _note(self, error: str | None):
        if error:
            self.errors.append(error)

    def input(self, rank, shape, dtype, op="", salt="") -> torch.Tensor:
        """`rank`'s deterministic input for this check (any rank can build any rank's)."""
        return make_input(f"{self.check}|{salt}|{rank}", shape, dtype, op)

    def shapes(self, dtype) -> list[tuple[int, ...]]:
        # 0-dim (a loss scalar), empty, 1, W-1, odd, N-d, and sizes that fit no even split
        shapes = [(), (0,), (1,), (self.world - 1,), (7,), (7, 11, 13), MEDIUM]
        if dtype == torch.float32:
            shapes.append(LARGE)
        return list(dict.fromkeys(shapes))

    @property
    def peer(self) -> int:
        """The partner in two-rank checks."""
        return 1 - self.rank


def make_input(key: str, shape, dtype, op="") -> torch.Tensor:
    # crc32, not hash(): Python salts str hashes per process, and ranks must agree
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


def reference(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The exact reduction of all ranks' inputs: float64 for floating dtypes (compared with a
    tolerance), the input dtype otherwise (compared exactly)."""
    dtype = inputs[0].dtype
    if op in _BITWISE_FN:
        return functools.reduce(_BITWISE_FN[op], inputs)
    stacked = torch.stack(inputs)
    if dtype == torch.bool:  # NCCL semantics: SUM/MAX are OR, PRODUCT/MIN are AND
        return stacked.any(0) if op in ("SUM", "MAX") else stacked.all(0)
    wide = stacked.to(torch.float64 if dtype.is_floating_point else torch.int64)
    fns = {"SUM": wide.sum, "PRODUCT": wide.prod, "MIN": wide.amin, "MAX": wide.amax}
    out = wide.mean(0) if op == "AVG" else fns[op](0)
    return out if dtype.is_floating_point else out.to(dtype)


def tolerance(dtype, world) -> dict:
    # rounding of W-1 additions (or multiplications) of values in [-2, 2), in any order
    eps = torch.finfo(dtype).eps
    return {"rtol": 4 * world * eps, "atol": 8 * world * eps}


def reduced_mismatch(got: torch.Tensor, inputs: list[torch.Tensor], op: str, where: str) -> str | None:
    dtype = inputs[0].dtype
    expected = reference(inputs, op)
    if not (dtype.is_floating_point and op in ("SUM", "PRODUCT", "AVG")):
        return equal_mismatch(got, expected.to(dtype), where)
    if bad_meta := _meta_mismatch(got, inputs[0], where):
        return bad_meta
    tol = tolerance(dtype, len(inputs))
    close = torch.isclose(got.double(), expected, **tol)
    return None if bool(close.all()) else f"{where}: {_diff(got, expected, ~close)} (tolerance {tol})"


def equal_mismatch(got: torch.Tensor, expected: torch.Tensor, where: str) -> str | None:
    if bad_meta := _meta_mismatch(got, expected, where):
        return bad_meta
    if got.dtype == torch.bool and got.numel():
        # a bool must be stored as 0/1: other bytes compare True but break later arithmetic
        top = int(got.contiguous().view(torch.uint8).max())
        if top > 1:
            return f"{where}: bool tensor stores byte {top}"
    return None if torch.equal(got, expected) else f"{where}: {_diff(got, expected, got != expected)}"


def _meta_mismatch(got, expected, where) -> str | None:
    if got.dtype != expected.dtype:
        return f"{where}: dtype {got.dtype}, expected {expected.dtype}"
    if got.shape != expected.shape:
        return f"{where}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    return None


def _diff(got, expected, bad) -> str:
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


def check_group_usable(ctx: Ctx, where: str):
    """An all_reduce still works (after an error, say)."""
    t = torch.ones(3)
    dist.all_reduce(t)
    ctx.expect_equal(t, torch.full((3,), float(ctx.world)), f"all_reduce {where}")


def _reduce_op(op: str):
    return getattr(dist.ReduceOp, op)


def _gloo_gaps(dtype, op=None) -> dict[str, str]:
    """What Gloo lacks: skipped, not failed, when validating the checks against Gloo."""
    if dtype == torch.int16:
        return {"gloo": "Gloo has no int16 collectives"}
    if dtype == torch.bool and op == "SUM":
        return {"gloo": "Gloo adds bool bytes (stores 2)"}
    return {}


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


# ============================================================================= suite "collectives"


def _all_reduce_values(ctx: Ctx, dtype, op):
    for shape in ctx.shapes(dtype):
        inputs = [ctx.input(r, shape, dtype, op) for r in range(ctx.world)]
        t = inputs[ctx.rank].clone()
        dist.all_reduce(t, op=_reduce_op(op))
        ctx.expect_reduced(t, inputs, op, f"shape {shape}")


def _all_reduce_rejects(ctx: Ctx, dtype):
    for op in rejected_ops(dtype):
        t = torch.ones(5, dtype=dtype)
        expect_unsupported(ctx, lambda: dist.all_reduce(t, op=_reduce_op(op)), f"{op} on {dtype}")
    check_group_usable(ctx, "after the rejected ops")


def _broadcast_values(ctx: Ctx, dtype):
    for root in range(ctx.world):
        for shape in ctx.shapes(dtype):
            t = ctx.input(ctx.rank, shape, dtype, salt=root)  # non-roots start with other data
            dist.broadcast(t, src=root)
            ctx.expect_equal(t, ctx.input(root, shape, dtype, salt=root), f"root {root}, shape {shape}")


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
                 functools.partial(_all_reduce_values, dtype=_dtype, op=_op),
                 skip_on=_gloo_gaps(_dtype, _op))
    register("collectives", f"all_reduce_rejects-{_d}",
             functools.partial(_all_reduce_rejects, dtype=_dtype), skip_on=_gloo_gaps(_dtype))
for _dtype in DTYPES:
    register("collectives", f"broadcast-{dtype_name(_dtype)}",
             functools.partial(_broadcast_values, dtype=_dtype), skip_on=_gloo_gaps(_dtype))
for _layout in ("gapped", "transposed"):
    for _dtype, _op in ((torch.float32, "SUM"), (torch.bfloat16, "SUM"), (torch.int64, "SUM"),
                        (torch.uint8, "MAX"), (torch.bool, "MAX")):
        # Gloo reduces a gapped view as if it were contiguous, overwriting the gaps
        register("collectives", f"noncontiguous-{_layout}-{dtype_name(_dtype)}-{_op}",
                 functools.partial(_noncontiguous, layout=_layout, dtype=_dtype, op=_op),
                 skip_on={"gloo": "Gloo mishandles gapped views"} if _layout == "gapped" else {})


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
        assert work.exception() is None, f"op {i}: {work.exception()}"
        ctx.expect_reduced(t, inputs, op, f"op {i} ({t.dtype} {op} {tuple(t.shape)})")


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


# Delete or change this check when rustc10d implements all_to_all_single.
@check("collectives", skip_on={"gloo": "Gloo implements all_to_all_single"})
def unsupported_op_is_rejected(ctx: Ctx):
    out, inp = torch.zeros(ctx.world), torch.ones(ctx.world)
    expect_unsupported(ctx, lambda: dist.all_to_all_single(out, inp), "all_to_all_single", phrase="")
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
    assert work.exception() is None, work.exception()
    assert work.source_rank() == 1, f"source_rank() {work.source_rank()}"
    ctx.expect_equal(buf, payload, "received data")


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


# Keep this last but one: Gloo closes the connection on a receive timeout, so nothing may use the
# group after it there. A receive for this tag is never sent, by any check.
NEVER_SENT_TAG = 999


@check("p2p", worlds=(2,))
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


@check("p2p", worlds=(2,), skip_on={"gloo": "Gloo tears the connection down on a recv timeout"})
def usable_after_wait_timeout(ctx: Ctx):
    """A wait() that timed out is the caller's choice, not a broken group."""
    check_group_usable(ctx, "after a wait(timeout) expired")
    send = dist.isend(torch.full((3,), 7.0), dst=ctx.peer, tag=41)
    buf = torch.zeros(3)
    dist.recv(buf, src=ctx.peer, tag=41)
    send.wait()
    ctx.expect_equal(buf, torch.full((3,), 7.0), "p2p after a wait(timeout) expired")
