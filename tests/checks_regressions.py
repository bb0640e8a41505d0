"""Named regression checks: each is a case a user hit, or the differential suite found, that the
checks before it did not cover. Run by the main job (suite "collectives"), so over shared memory,
TCP and staged like CUDA tensors, at every world size. Each docstring says what was wrong.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from checks import Ctx, check, check_group_usable, make_input, new_group, reduced_mismatch


def _dense_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([t.to_dense() for t in tensors]).sum(0)


def _sparse_case(ctx: Ctx, name: str, make):
    """make(rank) -> a sparse COO tensor; every rank all_reduces its own and must hold the sum
    of every rank's, coalesced (as Gloo's result is)."""
    t = make(ctx.rank)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    expected = _dense_sum([make(r) for r in range(ctx.world)])
    ctx.expect_close(t.to_dense(), expected, f"sparse all_reduce, {name}", rtol=1e-6, atol=1e-6)
    if not t.is_coalesced():
        ctx.errors.append(f"sparse all_reduce, {name}: the result is not coalesced")
    if not work.is_success():
        ctx.errors.append(f"sparse all_reduce, {name}: wait() returned but is_success() is False")


@check("collectives")
def sparse_all_reduce_adds_rows_with_equal_indices(ctx: Ctx):
    """Rows with equal indices, across ranks and within one rank, were returned unsummed: each
    rank got its own input back. DDP's sparse gradients are uncoalesced, and the op failed
    on them ("Cannot get values on an uncoalesced tensor") while wait() said it succeeded."""
    cases = {
        # the same indices on every rank
        "overlapping": lambda r: torch.sparse_coo_tensor([[0, 2]], [1.0, r + 1.0], (4,)),
        # a 2-D tensor with a duplicate index on each rank, uncoalesced
        "duplicates, 2-D": lambda r: torch.sparse_coo_tensor([[0, 0, 1], [1, 1, 0]], [1.0, 2.0, r + 0.5], (2, 2)),
        # no rows on odd ranks
        "empty on some ranks": lambda r: torch.sparse_coo_tensor(
            torch.zeros((1, 0), dtype=torch.long) if r % 2 else torch.tensor([[r]]),
            torch.ones(0) if r % 2 else torch.ones(1), (8,)),
        # hybrid: one sparse dimension, rows of a dense (3, 2) part, uncoalesced
        "hybrid": lambda r: torch.sparse_coo_tensor(
            [[r % 3, 1, r % 3]], make_input(f"hybrid|{r}", (3, 3, 2), torch.float32), (5, 3, 2)),
        # float64 values, indices in every rank's range
        "float64, 3 sparse dims": lambda r: torch.sparse_coo_tensor(
            [[0, r % 2], [1, 1], [r, 0]], torch.tensor([1.5, -2.0], dtype=torch.float64), (2, 2, 8)),
    }
    for name, make in cases.items():
        _sparse_case(ctx, name, make)
    check_group_usable(ctx, "after sparse all_reduces")


@check("collectives", skip_on={"gloo": "torch's Gloo backend reduces a sparse tensor of any shape"})
def sparse_all_reduce_of_different_shapes_is_a_mismatch(ctx: Ctx):
    """Ranks whose sparse tensors differ in size must all learn of it, not add up rows of
    different tensors. On a group of its own, which the mismatch breaks."""
    group = new_group()
    t = torch.sparse_coo_tensor([[0]], [1.0], (4 + (ctx.rank == ctx.world - 1),))
    try:
        dist.all_reduce(t, group=group)
    except RuntimeError as e:
        assert "does not match" in str(e), f"expected a mismatch, got {e}"
    else:
        raise AssertionError("a sparse all_reduce of tensors of different sizes did not raise")
    check_group_usable(ctx, "after a mismatch on another group")


@check("collectives")
def misaligned_views_reduce_like_aligned_ones(ctx: Ctx):
    """A float32 view 2 bytes into a buffer (torch.frombuffer(..., offset=2), legal in torch)
    panicked the reduction kernel ("misaligned buffer") and broke the group."""
    for dtype, n in ((torch.float32, 9), (torch.float64, 1000), (torch.int64, 3), (torch.bfloat16, 70_001)):
        size = torch.tensor([], dtype=dtype).element_size()
        inputs = [make_input(f"misaligned|{r}|{dtype}", (n,), dtype, "SUM") for r in range(ctx.world)]
        for offset in (1, size // 2 + 1):
            if offset % size == 0:
                continue
            buf = bytearray(n * size + offset)
            view = torch.frombuffer(buf, dtype=dtype, offset=offset, count=n)
            assert view.data_ptr() % size != 0 or size == 1, "the view should be misaligned"
            view.copy_(inputs[ctx.rank])
            dist.all_reduce(view)
            ctx._note(reduced_mismatch(view.clone(), inputs, "SUM", f"all_reduce {dtype} {n} at offset {offset}"))
    check_group_usable(ctx, "after all_reduces of misaligned views")


@check("collectives")
def parameters_are_reduced_and_broadcast_under_no_grad(ctx: Ctx):
    """A parameter that requires grad, reduced under torch.no_grad() (model averaging, EMA):
    staged like a CUDA tensor it failed ("a leaf Variable that requires grad is being used in
    an in-place operation") and broke the group. Non-contiguous ones are copied back too."""
    p = torch.nn.Parameter(torch.full((8,), float(ctx.rank + 1)))
    q = torch.nn.Parameter(torch.full((4, 6), float(ctx.rank + 1)))
    with torch.no_grad():
        dist.all_reduce(p)
        dist.all_reduce(q.t())  # non-contiguous: staged through a contiguous copy
        dist.broadcast(p, 0)
    total = float(ctx.world * (ctx.world + 1) // 2)
    ctx.expect_equal(p.detach(), torch.full((8,), total), "all_reduce of a parameter")
    ctx.expect_equal(q.detach(), torch.full((4, 6), total), "all_reduce of a transposed parameter")
    if not (p.requires_grad and p.is_leaf):
        ctx.errors.append("the parameter no longer requires grad or is no longer a leaf")
    check_group_usable(ctx, "after ops on parameters")


@check("collectives")
def every_op_writes_tensors_that_require_grad_under_no_grad_and_inference_mode(ctx: Ctx):
    """Issue 29, every op that writes into a tensor the caller passes: into parameters, a view
    of one and a parameter with a hook, under torch.no_grad() and torch.inference_mode(). Staged
    like CUDA tensors the first of these failed and broke the group. The results must be those
    of plain tensors, and the autograd state unchanged: leaves that require grad, no hook run."""
    w, r = ctx.world, ctx.rank
    total = float(w * (w + 1) // 2)
    fired = []

    def param(n, value=None):
        return torch.nn.Parameter(torch.full((n,), float(r + 1 if value is None else value)))

    for name, mode in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        hooked, big = param(4), param(12)
        hooked.register_hook(fired.append)
        cast, reduced, gathered, scattered_out, exchanged, scattered, received = (
            param(5), param(3), param(3 * w, -1), param(3, -1), param(2 * w, -1), param(3, -1), param(4, -1))
        with mode():
            dist.all_reduce(hooked)
            dist.all_reduce(big[4:8])  # a view of a parameter
            dist.broadcast(cast, 0)
            dist.reduce(reduced, 0)
            dist.all_gather_into_tensor(gathered, torch.full((3,), float(r)))
            dist.reduce_scatter_tensor(scattered_out, torch.full((3 * w,), float(r + 1)))
            dist.all_to_all_single(exchanged, torch.full((2 * w,), float(r)))
            dist.scatter(scattered, [torch.full((3,), float(j)) for j in range(w)] if r == 0 else None, 0)
            if r == 0:
                dist.send(torch.full((4,), 7.0), 1)
            elif r == 1:
                dist.recv(received, 0)
        at = f"under {name}"
        blocks = torch.arange(w, dtype=torch.float32)
        ctx.expect_equal(hooked.detach(), torch.full((4,), total), f"all_reduce of a hooked parameter {at}")
        want = torch.full((12,), float(r + 1))
        want[4:8] = total
        ctx.expect_equal(big.detach(), want, f"all_reduce of a view of a parameter {at}")
        ctx.expect_equal(cast.detach(), torch.full((5,), 1.0), f"broadcast into a parameter {at}")
        if r == 0:
            ctx.expect_equal(reduced.detach(), torch.full((3,), total), f"reduce into a parameter {at}")
        ctx.expect_equal(gathered.detach(), blocks.repeat_interleave(3), f"all_gather_into_tensor {at}")
        ctx.expect_equal(scattered_out.detach(), torch.full((3,), total), f"reduce_scatter_tensor {at}")
        ctx.expect_equal(exchanged.detach(), blocks.repeat_interleave(2), f"all_to_all_single {at}")
        ctx.expect_equal(scattered.detach(), torch.full((3,), float(r)), f"scatter into a parameter {at}")
        if r == 1:
            ctx.expect_equal(received.detach(), torch.full((4,), 7.0), f"recv into a parameter {at}")
        for p in (hooked, big, cast, reduced, gathered, scattered_out, exchanged, scattered, received):
            if not (p.requires_grad and p.is_leaf and p.grad is None):
                ctx.errors.append(f"a parameter {at} no longer requires grad, is no longer a leaf, or has a grad")
    if fired:
        ctx.errors.append(f"a parameter's hook ran {len(fired)} times")
    check_group_usable(ctx, "after ops on parameters")


# ----------------------------------------------------------------------------- found by the differential suite
# (tests/checks_differential.py); each names its call there.


def _raised(ctx: Ctx, what: str, call, watched: dict[str, torch.Tensor]) -> RuntimeError | None:
    """Run call(), which must raise a RuntimeError (returned) and change none of `watched`."""
    before = {name: t.clone() for name, t in watched.items()}
    raised = None
    try:
        call()
    except RuntimeError as e:
        raised = e
    else:
        ctx.errors.append(f"{what}: rank {ctx.rank} did not raise")
    for name, t in watched.items():
        if not torch.equal(t, before[name]):
            ctx.errors.append(f"{what}: rank {ctx.rank}'s {name} changed")
    return raised


def _refused_at_issue(ctx: Ctx, what: str, call, watched: dict[str, torch.Tensor]):
    """call(group) must raise a RuntimeError naming rustc10d before anything leaves the rank
    (not a group failure) and change none of `watched`; the group must work afterwards. On a
    group of its own: while the bug is there, the call breaks its group, and the main job's
    later checks must not pay for that."""
    group = new_group()
    e = _raised(ctx, what, lambda: call(group), watched)
    if isinstance(e, (dist.DistBackendError, dist.DistNetworkError)):
        ctx.errors.append(f"{what}: failed as a group, not refused at issue: {e}")
    elif e is not None and ctx.backend == "rustc10d" and "rustc10d" not in str(e):
        ctx.errors.append(f"{what}: the error does not name rustc10d: {e}")
    try:
        probe = torch.ones(3)
        dist.all_reduce(probe, group=group)
        ctx.expect_equal(probe, torch.full((3,), float(ctx.world)), f"an all_reduce on the group after {what}")
    except RuntimeError as e:
        ctx.errors.append(f"the group is not usable after {what}: {e}")
    check_group_usable(ctx, f"after {what} on another group")


@check("collectives", skip_on={"gloo": "rustc10d's refusals"})
def all_to_all_single_even_split_of_rows_the_group_does_not_divide_is_refused(ctx: Ctx):
    """all_to_all_single without split sizes of a tensor whose dim 0 (W+1 rows) W does not
    divide returned success with garbage where W divides its bytes: at W=2 the 12 bytes of
    3 float32 were cut into blocks of 6 bytes, rows torn apart (at W=3, 16 bytes, it was
    refused). Gloo: "Tensor's dim 0 does not divide equally across group size".
    (Differential call: local all_to_all_single, sizes_do_not_fit, rows_not_divisible.)"""
    rows = ctx.world + 1
    x, out = torch.arange(rows, dtype=torch.float32) + 100 * ctx.rank, torch.full((rows,), -1.0)
    _refused_at_issue(ctx, "an even all_to_all_single of W+1 rows",
                      lambda g: dist.all_to_all_single(out, x, group=g), {"input": x, "output": out})


@check("collectives", skip_on={"gloo": "rustc10d's refusals"})
def all_to_all_single_even_split_into_a_smaller_output_is_refused(ctx: Ctx):
    """all_to_all_single without split sizes, input 2W rows, output W: every rank can see the
    blocks do not fit, but the call went on the wire and broke the group: in the shared arena
    "does not match the calls of its peers: rank 0 sends 8 bytes to rank 0, which expects 4",
    over TCP or without the arena a panic on the engine thread ("hit an internal error:
    assertion `left == right` failed: copy_buf: length mismatch"). (Differential call: local
    all_to_all_single, sizes_do_not_fit, output_smaller.)"""
    x, out = torch.ones(2 * ctx.world), torch.zeros(ctx.world)
    _refused_at_issue(ctx, "an even all_to_all_single into a smaller output",
                      lambda g: dist.all_to_all_single(out, x, group=g), {"input": x, "output": out})


@check("collectives", skip_on={"gloo": "rustc10d's refusals"})
def all_gather_into_tensor_of_another_dtype_is_refused(ctx: Ctx):
    """all_gather_into_tensor into an int32 output from a float32 input (the same bytes)
    copied the bytes: the output held 1065353216 for 1.0. reduce_scatter_tensor refuses the
    same call ("all tensors must have the same dtype"), as Gloo does both. (Differential
    call: local all_gather_into_tensor, dtypes_differ.)"""
    x, out = torch.ones(3), torch.zeros(3 * ctx.world, dtype=torch.int32)
    _refused_at_issue(ctx, "an all_gather_into_tensor of float32 into int32",
                      lambda g: dist.all_gather_into_tensor(out, x, group=g), {"input": x, "output": out})


def _expect_mismatch(ctx: Ctx, what: str, call, watched: dict[str, torch.Tensor]):
    """On a group of its own (a matching all_reduce first, so every rank has joined it): call()
    must raise "does not match" on every rank and change none of `watched`."""
    group = new_group()
    dist.all_reduce(torch.ones(1), group=group)
    e = _raised(ctx, what, lambda: call(group), watched)
    if e is not None and "does not match" not in str(e):
        ctx.errors.append(f"{what}: expected a mismatch, got {type(e).__name__}: {e}")
    dist.destroy_process_group(group)


@check("collectives", skip_on={"gloo": "Gloo does not check calls against each other"})
def ranks_that_disagree_on_the_dtype_are_a_mismatch(ctx: Ctx):
    """A broadcast whose root passes float32 and whose other ranks pass int32 (or float64
    against int64: the same bytes) went through: the receivers held the root's bytes as
    integers, and nobody raised. all_gather_into_tensor the same. The README says the call
    check compares the dtype. (Differential calls: mismatch broadcast / all_gather_into_tensor,
    dtype.)"""
    dtype = torch.float32 if ctx.rank == 0 else torch.int32
    t = torch.full((5,), 3, dtype=dtype)
    _expect_mismatch(ctx, "broadcast, float32 at the root, int32 elsewhere",
                     lambda g: dist.broadcast(t, src=0, group=g), {"tensor": t})
    dtype = torch.float64 if ctx.rank == ctx.world - 1 else torch.int64
    x, out = torch.full((300,), 7, dtype=dtype), torch.zeros(300 * ctx.world, dtype=dtype)
    _expect_mismatch(ctx, "all_gather_into_tensor, float64 on the last rank, int64 elsewhere",
                     lambda g: dist.all_gather_into_tensor(out, x, group=g), {"output": out})
    check_group_usable(ctx, "after the mismatches on other groups")


@check("collectives", skip_on={"gloo": "rustc10d's own op"})
def the_direct_all_reduce_op_called_differently_is_a_mismatch_on_every_rank(ctx: Ctx):
    """rustc10d.all_reduce_ (and all_reducer's callable) on an idle group runs on the caller's
    thread with no job, status or Work around it (Engine::run_here): a call that differs across
    ranks must still raise "does not match" on every rank and change no tensor, as
    dist.all_reduce does."""
    import rustc10d
    t = torch.ones(64 + (ctx.rank == ctx.world - 1))
    _expect_mismatch(ctx, "all_reduce_, the last rank with one element more",
                     lambda g: rustc10d.all_reduce_(t, group=g), {"tensor": t})
    u = torch.ones(8)
    op = dist.ReduceOp.MAX if ctx.rank == 0 else dist.ReduceOp.SUM
    _expect_mismatch(ctx, "all_reduce_, MAX on rank 0 and SUM elsewhere",
                     lambda g: rustc10d.all_reduce_(u, op, group=g), {"tensor": u})
    _expect_mismatch(ctx, "all_reducer's callable, MAX on rank 0 and SUM elsewhere",
                     lambda g: rustc10d.all_reducer(op, group=g)(u), {"tensor": u})
    check_group_usable(ctx, "after the direct op's mismatches on other groups")


@check("collectives", skip_on={"gloo": "Gloo does not check calls against each other"})
def all_to_all_single_splits_that_disagree_are_a_mismatch_on_every_rank(ctx: Ctx):
    """Rank 0 sends rank 1 one row more than rank 1's output splits expect. Over TCP and
    without the arena only rank 1 raised, and not as a mismatch ("size mismatch: the receive
    expects 28 bytes but the peer sent 32"), its output already partly written; the other
    ranks, rank 0 among them, returned success. (Differential call: mismatch
    all_to_all_single, all_to_all_rows.)"""
    n, w = 7, ctx.world
    in_splits = [n + (ctx.rank == 0 and r == 1) for r in range(w)]
    x, out = torch.ones(sum(in_splits)), torch.zeros(n * w)
    _expect_mismatch(ctx, "all_to_all_single, rank 0 sends rank 1 a row more",
                     lambda g: dist.all_to_all_single(out, x, [n] * w, in_splits, group=g), {"output": out})
    check_group_usable(ctx, "after the mismatch on another group")


@check("collectives", worlds=(3,), skip_on={"gloo": "Gloo does not check calls against each other"})
def a_mismatch_at_three_ranks_raises_on_every_rank_and_changes_nothing(ctx: Ctx):
    """At W=3 without the arena (TCP; shm with RUSTC10D_ARENA_SLOT_BYTES=0) a rank checks only
    its left neighbour's call: rank 2 passes a larger tensor, rank 1 (whose neighbour rank 0
    matches) went on. A reduce to rank 0 returned success on rank 1; an all_gather_into_tensor
    raised on rank 1 only after writing rank 0's block into its output. The README: "a
    difference raises ... on every rank, and no tensor changes". (Differential calls:
    mismatch reduce / all_gather_into_tensor / all_gather, size and root.)"""
    n = 5000 + (ctx.rank == 2)
    t = torch.ones(n, dtype=torch.bfloat16)
    _expect_mismatch(ctx, "reduce, rank 2 with one element more", lambda g: dist.reduce(t, dst=0, group=g),
                     {"tensor": t} if ctx.rank else {})
    x, out = torch.ones(n), torch.zeros(3 * n)
    _expect_mismatch(ctx, "all_gather_into_tensor, rank 2 with one element more",
                     lambda g: dist.all_gather_into_tensor(out, x, group=g), {"output": out})
    check_group_usable(ctx, "after the mismatches on other groups")


@check("collectives", worlds=(2,), job="regression-empty-lists", skip_on={"gloo": "rustc10d's refusals"})
def empty_output_or_input_lists_are_refused(ctx: Ctx):
    """all_gather with an empty output list, and reduce_scatter with an empty input list,
    aborted the process: a Rust panic in src/ffi/translate.rs per_part ("chunk size must be
    non-zero", ts.chunks(0)) crossed the FFI ("panic in ffi function ... Group::submit,
    aborting"). Gloo refuses both ("invalid output tensor list at index 0 (expected length 2,
    got 0)"). A job of its own: while the bug is there the process dies, and the main job's
    later checks must not die with it. (Differential call: local all_gather / reduce_scatter,
    wrong_list_length, length 0.)"""
    x = torch.ones(3)
    _refused_at_issue(ctx, "an all_gather into an empty list", lambda g: dist.all_gather([], x, group=g), {"input": x})
    out = torch.zeros(3)
    _refused_at_issue(ctx, "a reduce_scatter of an empty list", lambda g: dist.reduce_scatter(out, [], group=g),
                      {"output": out})


@check("collectives", worlds=(4,), job="regression-first-op-mismatch",
       skip_on={"gloo": "Gloo does not check calls against each other"})
def a_mismatch_as_a_new_groups_first_op_ends_within_the_timeout(ctx: Ctx):
    """Mismatched calls as the first op of a group just made, without the shared arena, W=4:
    now and then a rank never returned, past the group's timeout. In the differential suite's
    noarena W=4 job (seed 1, calls 46 and 48 as first ops): ranks 0-2 all_reduce 70001
    float16, rank 3 broadcasts them from rank 0; ranks 0-2 raised, rank 3 still waited in
    broadcast after 75 s with a 30 s timeout (about one run in four; and once rank 0, the root
    of call 46's reduce, to which rank 1 passed one element more). Every rank must raise within
    the timeout (any error: one may come from new_group itself, the slower members still
    joining): the check's deadline (75 s) ends a rank that does not. Those two calls, ten
    times, through the differential suite's runner, in a job of its own: its groups are made
    without the arena, and a hung rank ends its job."""
    import checks_differential
    import diff_calls

    os.environ["RUSTC10D_ARENA_SLOT_BYTES"] = "0"  # read by every group made from here on
    runner = checks_differential.Runner(ctx, checks_differential.Groups(ctx.world))
    for _ in range(10):
        for index in (46, 48):
            call = diff_calls.generate(1, ctx.world, index)
            runner.run(dataclasses.replace(call, params=call.params + (("first_op", True),)))


@check("collectives", worlds=(3, 4), job="regression-join-after-give-up",
       skip_on={"gloo": "rustc10d's join and call check"})
def a_rank_still_joining_when_its_peers_give_up_joins_and_raises_with_them(ctx: Ctx):
    """A new group's first op is a mismatch, which the other ranks find while rank 1 is still
    joining (RUSTC10D_TEST_JOIN_PAUSE_MS holds it back in its join, as a busy machine can: CI
    saw it at W=4 over TCP). Rank 1's new_group raised "could not join the process group: rank
    0 ... gave up on the group", so it had no group where its peers had one, and every later
    check of the job failed. Now it joins, its op raises the mismatch too, and the ranks stay
    in step. (Over shared memory the arena's call check waits for every rank, so there the
    pause only delays the mismatch.)"""
    pause = "RUSTC10D_TEST_JOIN_PAUSE_MS"
    if ctx.rank == 1:
        os.environ[pause] = "1500"
    try:
        group = new_group()
    finally:
        os.environ.pop(pause, None)
    t = torch.ones(8, dtype=torch.float64 if ctx.rank == 0 else torch.float32)
    e = _raised(ctx, "an all_reduce of float64 on rank 0, float32 elsewhere", lambda: dist.all_reduce(t, group=group),
                {"tensor": t})
    if e is not None and "does not match" not in str(e):
        ctx.errors.append(f"expected a mismatch, got {type(e).__name__}: {e}")
    dist.destroy_process_group(group)
    check_group_usable(ctx, "after a mismatch on a group that a rank joined late")


@check("collectives", skip_on={"gloo": "Gloo returns wrong numbers for all_to_all_single(t, t)"})
def buffers_that_share_memory_give_what_separate_tensors_give(ctx: Ctx):
    """Views of one tensor passed as several buffers of an op. Over TCP, all_to_all_single(t, t)
    and a reduce_scatter_tensor whose output was another rank's block of its own input returned
    wrong numbers without a word (Gloo gets the first wrong too). Each must give what separate
    tensors give; one tensor twice in an output list holds the last block, as in Gloo."""
    w, r = ctx.world, ctx.rank
    nxt = (r + 1) % w
    for n in (5, 70_000):  # small, and blocks that go as addresses or take several arena rounds
        ar = torch.arange(n, dtype=torch.float32)
        block = lambda t, p: t[p * n:(p + 1) * n]  # noqa: E731
        # all_to_all_single in place: rank r's block p is r*100 + p*10 + i
        t = torch.cat([ar + r * 100 + p * 10 for p in range(w)])
        dist.all_to_all_single(t, t)
        ctx.expect_equal(t, torch.cat([ar + p * 100 + r * 10 for p in range(w)]), f"all_to_all_single(t, t), {n}")
        # all_to_all with lists, each output the tensor of another peer's input
        ins = [ar + r * 100 + p * 10 for p in range(w)]
        outs = [ins[(p + 1) % w] for p in range(w)]
        want = [ar + p * 100 + r * 10 for p in range(w)]
        dist.all_to_all(outs, ins)
        for p in range(w):
            ctx.expect_equal(outs[p], want[p], f"all_to_all into other inputs, block {p}, {n}")
        # all_gather_into_tensor, the input another rank's block of the output
        o = torch.zeros(w * n)
        block(o, nxt).copy_(ar + r)
        dist.all_gather_into_tensor(o, block(o, nxt))
        ctx.expect_equal(o, torch.cat([ar + p for p in range(w)]), f"all_gather_into_tensor from another block, {n}")
        # all_gather_into_tensor in place, the input its own block of the output (as FSDP2 calls it)
        o = torch.zeros(w * n)
        block(o, r).copy_(ar + r)
        dist.all_gather_into_tensor(o, block(o, r))
        ctx.expect_equal(o, torch.cat([ar + p for p in range(w)]), f"all_gather_into_tensor in place, {n}")
        # reduce_scatter_tensor, the output another rank's block of the input
        i = torch.cat([ar + r * 10 + p for p in range(w)])
        expected = ar * w + 10 * w * (w - 1) // 2 + w * r
        out = block(i, nxt)
        dist.reduce_scatter_tensor(out, i)
        ctx.expect_equal(out, expected, f"reduce_scatter_tensor into another block, {n}")
        # all_gather into one tensor w times: the last rank's block wins
        x = torch.zeros(n)
        dist.all_gather([x] * w, ar + r)
        ctx.expect_equal(x, ar + (w - 1), f"all_gather into one tensor {w} times, {n}")
        # gather whose root's input is rank 1's slot; scatter whose root's output is rank 1's input
        slots = [torch.full((n,), -1.0) for _ in range(w)]
        mine = slots[1] if r == 0 else ar + r
        if r == 0:
            mine.copy_(ar)
        dist.gather(mine, slots if r == 0 else None, dst=0)
        if r == 0:
            for p in range(w):
                ctx.expect_equal(slots[p], ar + p, f"gather into the root's own input, slot {p}, {n}")
        sources = [ar + 7 * p for p in range(w)]
        got = sources[1] if r == 0 else torch.zeros(n)
        dist.scatter(got, sources if r == 0 else None, src=0)
        ctx.expect_equal(got, ar + 7 * r, f"scatter into one of the root's inputs, {n}")
    check_group_usable(ctx, "after ops on buffers that share memory")
