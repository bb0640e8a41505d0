"""Checks of every other torch.distributed op, run by the main job (see checks.py): rooted and
list collectives, the *_into_tensor / *_tensor forms, all_to_all, the coalesced forms, object
collectives, complex tensors, many ops in flight at once, receive from any source, batched
p2p, sub-groups, sequence numbers and monitored_barrier.

Most checks are one of the *_case functions of checks.py run over shapes (checks.sweep), or a
coalesced variant; dtype x op is swept in full for reduce and reduce_scatter_tensor only, the
other ops run a few dtypes that between them cover every element size and bool.
"""

from __future__ import annotations

import functools
import gc
import inspect
import os
import re
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from checks import (
    DTYPES,
    GROUP_TIMEOUT,
    MEDIUM,
    PREMUL_FACTOR,
    Ctx,
    all_gather_case,
    all_gather_coalesced_case,
    all_gather_into_tensor_case,
    all_reduce_case,
    all_reduce_coalesced_case,
    all_to_all_case,
    all_to_all_single_case,
    barrier_case,
    broadcast_case,
    check,
    check_group_usable,
    coalesced_case,
    dtype_name,
    expect_unsupported,
    gather_case,
    gather_into_tensor_case,
    gloo_gaps,
    new_group,
    reduce_case,
    reduce_scatter_case,
    reduce_scatter_tensor_case,
    register,
    ring_p2p_case,
    scatter_case,
    supported_ops,
    sweep,
    wait_done,
)

# Data movement does not depend on the dtype beyond its element size: 4, 2 and 8 bytes, and bool.
MOVE_DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)
# dtype x op pairs for the reducing ops that are not swept in full
REDUCE_COMBOS = ((torch.float32, "SUM"), (torch.float64, "AVG"), (torch.int64, "MAX"),
                 (torch.uint8, "BXOR"), (torch.bool, "MIN"), (torch.bfloat16, "PREMUL_SUM"))
# the tensors of one coalesced call: empty, single, odd, N-d and medium
COALESCED_SHAPES = ((0,), (1,), (7,), (7, 11, 13), MEDIUM)
NO_GATHER_INTO_TENSOR = {"gloo": "Gloo has no gather_into_tensor (gather_single)"}
if not hasattr(dist, "gather_into_tensor"):  # new in torch 2.14
    NO_GATHER_INTO_TENSOR["rustc10d"] = f"torch {torch.__version__} has no gather_into_tensor"
NO_UNEVEN_ALL_TO_ALL = {"gloo": "Gloo's all_to_all needs equal tensor sizes"}


def _coalesced_values(ctx: Ctx, case, dtype, **params):
    """All of COALESCED_SHAPES in one coalesced call, synchronously, then asynchronously."""
    for async_op in (False, True):
        handle, verify = case(ctx, dtype, COALESCED_SHAPES, async_op=async_op, salt=async_op, **params)
        wait_done(handle, f"{ctx.check} (async_op={async_op})")
        verify()


# ============================================================================= suite "collectives"

for _dtype in DTYPES:
    _d = dtype_name(_dtype)
    for _op in supported_ops(_dtype):
        register("collectives", f"reduce-{_d}-{_op}",
                 functools.partial(sweep, case=reduce_case, dtype=_dtype, rooted=True, op=_op),
                 skip_on=gloo_gaps(_dtype, _op))
        # no LARGE: its input is world x MEDIUM already, past the chunk sizes
        register("collectives", f"reduce_scatter_tensor-{_d}-{_op}",
                 functools.partial(sweep, case=reduce_scatter_tensor_case, dtype=_dtype, op=_op, scalar=False,
                                   large=False),
                 skip_on=gloo_gaps(_dtype, _op))

for _dtype, _op in REDUCE_COMBOS:
    _name, _gaps = f"{dtype_name(_dtype)}-{_op}", gloo_gaps(_dtype, _op)
    register("collectives", f"reduce_scatter-{_name}",
             functools.partial(sweep, case=reduce_scatter_case, dtype=_dtype, op=_op, large=False), skip_on=_gaps)
    register("collectives", f"all_reduce_coalesced-{_name}",
             functools.partial(_coalesced_values, case=all_reduce_coalesced_case, dtype=_dtype, op=_op),
             skip_on=_gaps)
    for _inner in (all_reduce_case, reduce_scatter_tensor_case):
        register("collectives", f"coalescing_manager-{_inner.__name__.removesuffix('_case')}-{_name}",
                 functools.partial(_coalesced_values, case=coalesced_case, dtype=_dtype, inner=_inner, op=_op),
                 skip_on=_gaps)

# name -> (case, sweep() options, Gloo gaps). LARGE (float32) only for all_gather_into_tensor,
# for run time: the others move world x MEDIUM already, past the chunk sizes.
_MOVES = {
    "all_gather": (all_gather_case, {}, {}),
    "all_gather_into_tensor": (all_gather_into_tensor_case, {"scalar": False, "large": None}, {}),
    "gather": (gather_case, {"rooted": True}, {}),
    "gather_into_tensor": (gather_into_tensor_case, {"rooted": True, "scalar": False}, NO_GATHER_INTO_TENSOR),
    "scatter": (scatter_case, {"rooted": True}, {}),
    "all_to_all_single": (all_to_all_single_case, {"scalar": False}, {}),
    "all_to_all_single_uneven": (all_to_all_single_case, {"scalar": False, "uneven": True}, {}),
    "all_to_all": (all_to_all_case, {"scalar": False}, {}),
    "all_to_all_uneven": (all_to_all_case, {"scalar": False, "uneven": True}, NO_UNEVEN_ALL_TO_ALL),
}
for _dtype in MOVE_DTYPES:
    _d = dtype_name(_dtype)
    for _name, (_case, _options, _gaps) in _MOVES.items():
        register("collectives", f"{_name}-{_d}",
                 functools.partial(sweep, case=_case, dtype=_dtype, **{"large": False, **_options}), skip_on=_gaps)
    register("collectives", f"all_gather_coalesced-{_d}",
             functools.partial(_coalesced_values, case=all_gather_coalesced_case, dtype=_dtype))
    register("collectives", f"coalescing_manager-all_gather_into_tensor-{_d}",
             functools.partial(_coalesced_values, case=coalesced_case, dtype=_dtype, inner=all_gather_into_tensor_case))

# complex tensors reach the backend as float pairs (torch.view_as_real), where torch allows them
register("collectives", "all_reduce-complex64-SUM",
         functools.partial(sweep, case=all_reduce_case, dtype=torch.complex64, op="SUM", large=False))
# Reductions of the dtypes Gloo has none of, each against arithmetic. complex: torch's all_reduce
# hands them on as pairs of reals (above), reduce and reduce_scatter as complex, which rustc10d
# reduces as such pairs by the ops that act on each part alone (SUM, AVG, PREMUL_SUM), as NCCL
# does. uint16/32/64 reduce like the other integers (wrapping, unsigned order).
# name -> (case, sweep() options)
_GLOOLESS_REDUCTIONS = {
    "reduce-complex128-AVG": (reduce_case, {"dtype": torch.complex128, "op": "AVG", "rooted": True}),
    "reduce_scatter-complex64-PREMUL_SUM": (reduce_scatter_case, {"dtype": torch.complex64, "op": "PREMUL_SUM"}),
    "reduce_scatter_tensor-complex64-SUM":
        (reduce_scatter_tensor_case, {"dtype": torch.complex64, "op": "SUM", "scalar": False}),
    "all_reduce-uint64-MAX": (all_reduce_case, {"dtype": torch.uint64, "op": "MAX"}),
    "all_reduce-uint32-SUM": (all_reduce_case, {"dtype": torch.uint32, "op": "SUM"}),
    "reduce-uint16-PRODUCT": (reduce_case, {"dtype": torch.uint16, "op": "PRODUCT", "rooted": True}),
    "reduce_scatter_tensor-uint64-MIN":
        (reduce_scatter_tensor_case, {"dtype": torch.uint64, "op": "MIN", "scalar": False}),
    "reduce_scatter-uint32-BXOR": (reduce_scatter_case, {"dtype": torch.uint32, "op": "BXOR"}),
}
for _name, (_case, _options) in _GLOOLESS_REDUCTIONS.items():
    register("collectives", _name, functools.partial(sweep, case=_case, large=False, **_options),
             skip_on={"gloo": f"Gloo has no {dtype_name(_options['dtype'])} reductions"})
register("collectives", "broadcast-complex64",
         functools.partial(sweep, case=broadcast_case, dtype=torch.complex64, rooted=True, large=False))
register("collectives", "all_gather_into_tensor-complex64",
         functools.partial(sweep, case=all_gather_into_tensor_case, dtype=torch.complex64, scalar=False, large=False))


@check("collectives", skip_on={"gloo": "Gloo has no PREMUL_SUM"})
def premul_sum_takes_a_one_element_tensor_factor(ctx: Ctx):
    """dist._make_nccl_premul_sum(tensor): of the input's dtype, as NCCL wants it, or another
    floating one; an integer factor is refused (torch refuses more than one element itself),
    and the group stays usable."""
    for dtype, factor_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.float64)):
        premul = dist._make_nccl_premul_sum(torch.tensor([PREMUL_FACTOR], dtype=factor_dtype))
        inputs = ctx.inputs((37, 3), dtype, "PREMUL_SUM")
        t = inputs[ctx.rank].clone()
        dist.all_reduce(t, op=premul)
        ctx.expect_reduced(t, inputs, "PREMUL_SUM", f"all_reduce {dtype}, factor a {factor_dtype} tensor")
        out = torch.zeros(37, 3, dtype=dtype)
        stacked = ctx.inputs((ctx.world * 37, 3), dtype, "PREMUL_SUM", salt="scatter")
        dist.reduce_scatter_tensor(out, stacked[ctx.rank], op=premul)
        to_me = [x[ctx.rank * 37:(ctx.rank + 1) * 37] for x in stacked]
        ctx.expect_reduced(out, to_me, "PREMUL_SUM", f"reduce_scatter_tensor {dtype}, factor a {factor_dtype} tensor")
    whole = dist._make_nccl_premul_sum(torch.tensor([2]))
    expect_unsupported(ctx, lambda: dist.all_reduce(torch.ones(4), op=whole), "PREMUL_SUM with an int64 factor")
    check_group_usable(ctx, "after a refused PREMUL_SUM factor")


@check("collectives")
def every_op_async_in_flight(ctx: Ctx):
    """One of every op, issued with async_op=True before any is waited on; then waited on in
    reverse order, each result checked."""
    last, f32 = ctx.world - 1, torch.float32
    issued = {
        "all_reduce": all_reduce_case(ctx, f32, (1001,), "SUM", async_op=True),
        "broadcast": broadcast_case(ctx, torch.int64, MEDIUM, last, async_op=True),
        "reduce": reduce_case(ctx, torch.float64, (7, 11), "MAX", root=last, async_op=True),
        "all_gather": all_gather_case(ctx, torch.bfloat16, (13,), async_op=True),
        "all_gather_into_tensor": all_gather_into_tensor_case(ctx, f32, MEDIUM, async_op=True),
        "all_gather_coalesced": all_gather_coalesced_case(ctx, torch.int32, ((3,), (5, 2)), async_op=True),
        "gather": gather_case(ctx, torch.uint8, (33,), root=0, async_op=True),
        "scatter": scatter_case(ctx, f32, (9, 2), root=last, async_op=True),
        "reduce_scatter": reduce_scatter_case(ctx, f32, (17,), "SUM", async_op=True),
        "reduce_scatter_tensor": reduce_scatter_tensor_case(ctx, torch.int64, (7,), "MIN", async_op=True),
        "all_to_all_single": all_to_all_single_case(ctx, f32, (3, 4), uneven=True, async_op=True),
        "all_to_all": all_to_all_case(ctx, torch.float16, (5,), async_op=True),
        "all_reduce_coalesced": all_reduce_coalesced_case(ctx, f32, ((2,), (3, 3)), "MAX", async_op=True),
        "coalesced all_reduce": coalesced_case(ctx, torch.float64, ((4,), (1,)), all_reduce_case, async_op=True),
        "barrier": barrier_case(ctx, async_op=True),
        "isend/irecv": ring_p2p_case(ctx, f32, (1001,)),
    }
    if ctx.backend not in NO_GATHER_INTO_TENSOR:
        issued["gather_into_tensor"] = gather_into_tensor_case(ctx, f32, (6,), root=last, async_op=True)
    for what, (handle, verify) in reversed(issued.items()):
        wait_done(handle, what)
        verify()


def _an_object(rank: int, salt: str = "") -> dict:
    """A picklable object whose size depends on the rank (so ranks pad to the largest)."""
    return {"from": rank, "salt": salt, "numbers": list(range(rank * 37)), "text": "x" * (1000 * rank + 3),
            "nested": ({"t": (rank, None, 1.5)}, b"\x00\xff" * rank)}


def _expect_object(ctx: Ctx, got, expected, where: str):
    if got != expected:
        ctx.errors.append(f"{where}: got {str(got)[:200]}, expected {str(expected)[:200]}")


@check("collectives")
def all_gather_object(ctx: Ctx):
    out = [None] * ctx.world
    dist.all_gather_object(out, _an_object(ctx.rank))
    for r in range(ctx.world):
        _expect_object(ctx, out[r], _an_object(r), f"object of rank {r}")


@check("collectives")
def broadcast_object_list(ctx: Ctx):
    for src in range(ctx.world):
        objects = [_an_object(ctx.rank, str(i)) for i in range(3)] if ctx.rank == src else [None] * 3
        dist.broadcast_object_list(objects, src=src)
        for i in range(3):
            _expect_object(ctx, objects[i], _an_object(src, str(i)), f"object {i} from rank {src}")


@check("collectives")
def gather_object(ctx: Ctx):
    for dst in range(ctx.world):
        out = [None] * ctx.world if ctx.rank == dst else None
        dist.gather_object(_an_object(ctx.rank, str(dst)), out, dst=dst)
        if ctx.rank == dst:
            for r in range(ctx.world):
                _expect_object(ctx, out[r], _an_object(r, str(dst)), f"object of rank {r} at rank {dst}")


@check("collectives")
def scatter_object_list(ctx: Ctx):
    for src in range(ctx.world):
        out = [None]
        objects = [_an_object(r, f"from {src}") for r in range(ctx.world)] if ctx.rank == src else None
        dist.scatter_object_list(out, objects, src=src)
        _expect_object(ctx, out[0], _an_object(ctx.rank, f"from {src}"), f"object from rank {src}")


@check("collectives")
def send_recv_object_list(ctx: Ctx):
    """Every ordered pair of ranks in turn: the others wait for their turn."""
    for src in range(ctx.world):
        for dst in range(ctx.world):
            objects = [_an_object(src, f"to {dst}"), _an_object(dst)]
            if src == dst or ctx.rank not in (src, dst):
                continue
            if ctx.rank == src:
                dist.send_object_list(objects, dst=dst)
                continue
            got = [None, None]
            sender = dist.recv_object_list(got, src=src)
            assert sender == src, f"recv_object_list returned {sender}, sent by {src}"
            _expect_object(ctx, got, objects, f"objects from rank {src}")


# ============================================================================= suite "p2p"


@check("p2p")
def recv_from_any_source(ctx: Ctx):
    """recv(src=None) takes a message from whichever rank sent it and returns the sender;
    irecv(src=None)'s Work names it by source_rank(). First round: the messages are there before
    the receives; second round: the receives wait before the messages are sent."""

    def payload(sender, tag):
        return ctx.input(sender, (5, 3), torch.float32, salt=tag)

    senders = set(range(1, ctx.world))
    for tag, late in ((61, "receiver"), (62, "senders")):
        if ctx.rank != 0:
            if late == "senders":
                time.sleep(0.3)
            dist.send(payload(ctx.rank, tag), dst=0, tag=tag)
            continue
        if late == "receiver":
            time.sleep(0.3)
        seen = set()
        for _ in senders:
            buf = torch.zeros(5, 3)
            if tag == 61:
                src = dist.recv(buf, tag=tag)
            else:
                work = dist.irecv(buf, tag=tag)
                work.wait()
                src = work.source_rank()
            assert src in senders - seen, f"tag {tag}: sender {src}, expected one of {sorted(senders - seen)}"
            seen.add(src)
            ctx.expect_equal(buf, payload(src, tag), f"tag {tag}: message of rank {src}")


@check("p2p")
def batch_isend_irecv(ctx: Ctx):
    """One batch of two sends to each neighbour and two receives from each (receives listed
    first on odd ranks; with two ranks both neighbours are the same peer, so messages must match
    in list order): every Work returned completes and every message lands where it belongs."""
    nxt, prv = (ctx.rank + 1) % ctx.world, (ctx.rank - 1) % ctx.world

    def msg(sender, direction, i):  # sizes differ, so a message matched to the wrong receive shows
        return ctx.input(sender, (100 * (i + 1) + (direction == "back"),), torch.float32, salt=f"{direction}{i}")

    sends, recvs, expected = [], [], []
    for (direction, to, frm) in (("on", nxt, prv), ("back", prv, nxt)):
        for i in range(2):
            sends.append(dist.P2POp(dist.isend, msg(ctx.rank, direction, i), to))
            expected.append(msg(frm, direction, i))
            recvs.append(dist.P2POp(dist.irecv, torch.zeros_like(expected[-1]), frm))
    ops = recvs + sends if ctx.rank % 2 else sends + recvs
    works = dist.batch_isend_irecv(ops)
    assert isinstance(works, list) and works, f"batch_isend_irecv returned {works!r}"
    wait_done(works, "batch_isend_irecv")
    for op, exp in zip(recvs, expected):
        ctx.expect_equal(op.tensor, exp, f"message of {exp.numel()} elements from rank {op.peer}")


@check("p2p", worlds=(2,))
def sends_past_the_early_bytes_cap_wait_for_their_receives(ctx: Ctx):
    """In a group whose ranks keep at most 1 MiB of a peer's messages for receives not yet
    posted (rustc10d.Options(early_bytes_max=...)), rank 1 sends 8 messages of 256 KiB before rank
    0 posts any receive: rank 0 keeps some but at most 1 MiB of them (rustc10d._native.retained;
    without the cap it read all 2 MiB in), while the rest wait in rank 1's socket or ring; then
    it receives all 8, in order, intact."""
    cap = 1 << 20
    if ctx.backend == "rustc10d":
        import rustc10d
        group = dist.new_group(backend="rustc10d", pg_options=rustc10d.Options(early_bytes_max=cap))
    else:
        group = dist.new_group(backend=ctx.backend)
    msgs = [ctx.input(1, (64 << 10,), torch.float32, salt=str(i)) for i in range(8)]
    if ctx.rank == 1:
        works = [dist.isend(m, dst=0, group=group, tag=70 + i) for i, m in enumerate(msgs)]
        wait_done(works, "isend past the cap")
    else:
        time.sleep(0.5)
        if ctx.backend == "rustc10d":
            kept = rustc10d._native.retained(group.group_name)["early_bytes"]
            assert 0 < kept <= cap, f"kept {kept} bytes of rank 1's messages for receives not posted, cap {cap}"
        for i, m in enumerate(msgs):
            buf = torch.zeros_like(m)
            dist.recv(buf, src=1, group=group, tag=70 + i)
            ctx.expect_equal(buf, m, f"message {i} of 256 KiB sent past the cap")
    dist.barrier(group=group)
    dist.destroy_process_group(group)


@check("p2p", worlds=(2,))
def receives_land_in_issue_order_when_stream_ordered(ctx: Ctx):
    """Two receives posted in one order, their messages sent in the other, 0.6 s apart. In
    stream order (test staging, as RUSTC10D_CUDA_WAIT=stream on a GPU: one stream orders every
    op of a group, as NCCL's does) the later receive's result lands only once the earlier
    receive has ended; in host mode each lands when its message does."""
    late = 0.6
    if ctx.rank == 1:
        dist.send(torch.full((5,), 2.0), dst=0, tag=72)
        time.sleep(late)
        dist.send(torch.full((5,), 1.0), dst=0, tag=71)
        return
    first, second = torch.zeros(5), torch.zeros(5)
    w_first = dist.irecv(first, src=1, tag=71)
    w_second = dist.irecv(second, src=1, tag=72)
    t0 = time.monotonic()
    w_second.wait()
    took = time.monotonic() - t0
    ctx.expect_equal(second, torch.full((5,), 2.0), "the second receive")
    if os.environ.get("RUSTC10D_TEST_STAGING") == "1":
        assert took > late / 2, f"the second receive landed after {took:.2f} s, before the first had ended"
        # Its copy back ran first, in stream order (its Work may say so a moment later).
        ctx.expect_equal(first, torch.full((5,), 1.0), "the first receive, once the second has landed")
    else:
        assert took < late / 2, f"the second receive waited {took:.2f} s for the first"
    w_first.wait()
    ctx.expect_equal(first, torch.full((5,), 1.0), "the first receive")


# ============================================================================= suite "groups"


def _group_ops(ctx: Ctx, group, salt="") -> list:
    """Async all_reduce, broadcast from the last member (a global rank), all_gather_into_tensor
    and reduce_scatter_tensor on `group`, issued by its members only."""
    members = dist.get_process_group_ranks(group)
    if ctx.rank not in members:
        return []
    f32 = torch.float32
    return [all_reduce_case(ctx, f32, (1001,), "SUM", async_op=True, salt=salt, group=group),
            broadcast_case(ctx, torch.int64, (7, 3), members[-1], async_op=True, salt=salt, group=group),
            all_gather_into_tensor_case(ctx, torch.bfloat16, (5,), async_op=True, salt=salt, group=group),
            reduce_scatter_tensor_case(ctx, f32, (3, 2), "MAX", async_op=True, salt=salt, group=group)]


def expect_group_works(ctx: Ctx, *groups):
    """_group_ops on each group, all in flight together, then waited on and checked."""
    issued = [op for i, g in enumerate(groups) for op in _group_ops(ctx, g, salt=str(i))]
    for handle, verify in issued:
        wait_done(handle, "sub-group op")
        verify()


@check("groups")
def pair_group(ctx: Ctx):
    """new_group([0, 1]); the other ranks only take part in creating it."""
    expect_group_works(ctx, new_group([0, 1]))


@check("groups", worlds=(4,))
def disjoint_groups_concurrently(ctx: Ctx):
    """[0, 1] and [2, 3] at the same time, and the whole world in between."""
    low, high = new_group([0, 1]), new_group([2, 3])
    world = all_reduce_case(ctx, torch.float32, (999,), async_op=True, salt="world")
    expect_group_works(ctx, low, high)
    wait_done(world[0], "world all_reduce")
    world[1]()


@check("groups", worlds=(3, 4))
def overlapping_groups(ctx: Ctx):
    """All ranks but the last, and all but the first: the middle ranks are in both, and have
    ops in flight on both at once."""
    ranks = list(range(ctx.world))
    expect_group_works(ctx, new_group(ranks[:-1]), new_group(ranks[1:]))


@check("groups")
def singleton_groups(ctx: Ctx):
    """A group of one rank per rank: each op is a local copy."""
    groups = [new_group([r]) for r in range(ctx.world)]
    expect_group_works(ctx, groups[ctx.rank])


@check("groups", worlds=(2, 4), skip_on={"gloo": "rustc10d's own connections"})
def new_groups_share_the_default_groups_connections(ctx: Ctx):
    """Groups made after the default group (new_group without pg_options, split_group) send
    over its connections, each in a channel of its own: 16 of them (every rank's, and pairs)
    cost this rank no descriptor once the default group is linked to every peer
    (connections of their own cost 3 per peer each), and their ops, in flight on all of them at
    once, are right. On one host, each runs in a shared arena of its own, as the world does."""
    import os

    import rustc10d

    # Every link of the default group up (its collectives may run in its arena instead).
    peers = [p for p in range(ctx.world) if p != ctx.rank]
    got = [torch.empty(1) for _ in peers]
    ops = [dist.P2POp(dist.isend, torch.ones(1), p) for p in peers]
    ops += [dist.P2POp(dist.irecv, g, p) for g, p in zip(got, peers)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    before = len(os.listdir("/proc/self/fd"))
    everyone = [new_group() for _ in range(8)]
    pairs = [new_group(sorted({r, (r + 1) % ctx.world})) for r in range(ctx.world)]
    pairs += [new_group([0, ctx.world - 1]) for _ in range(8 - ctx.world)]
    expect_group_works(ctx, *everyone, *pairs)
    after = len(os.listdir("/proc/self/fd"))
    assert after <= before + 1, f"16 groups took {after - before} descriptors"
    world_links = rustc10d.links()
    for g in everyone:
        assert rustc10d.links(g) == world_links, (rustc10d.links(g), world_links)
    for g in everyone + pairs:
        dist.destroy_process_group(g)


@check("groups", worlds=(2, 4), skip_on={"gloo": "rustc10d's shared arenas"})
def one_host_groups_lease_arenas_from_the_hosts_pool(ctx: Ctx):
    """Groups whose ranks share a host lease their arena from the pool that comes with the
    host's arena, without a message: an 8-float all_reduce there copies 32 bytes in, reads each
    peer's 32 and copies the sum out, (world + 1) * 32 bytes, where the rings copy several times
    that. The pool holds 64 arenas: of 70 groups alive at once (and those earlier checks left
    alive), those that came after it ran out, at least 6, run over the rings alike on every
    rank; once 8 of them are destroyed on every rank, 8 new groups lease their regions. Over TCP
    and staged (copies of their own) only the results are checked."""
    import os

    import rustc10d

    shm = os.environ.get("RUSTC10D_TRANSPORT", "auto") != "tcp" and os.environ.get("RUSTC10D_TEST_STAGING") != "1"
    in_arena = (ctx.world + 1) * 32

    def copied(g) -> int:
        x = torch.ones(8)
        dist.all_reduce(x, group=g)
        ctx.expect_equal(x, torch.full((8,), float(ctx.world)), "all_reduce on a new group")
        return int(rustc10d.stats(g)["allreduce"]["copied_bytes"])

    groups = [new_group() for _ in range(70)]
    costs = [copied(g) for g in groups]
    if shm:
        leased = [c == in_arena for c in costs]
        k = leased.index(False)
        assert 8 <= k <= 64 and not any(leased[k:]), f"copies per group: {costs}"
    for g in groups[:8]:
        dist.destroy_process_group(g)
    gc.collect()
    dist.barrier()
    again = [new_group() for _ in range(8)]
    costs = [copied(g) for g in again]
    if shm:
        assert costs == [in_arena] * 8, f"copies per group after 8 were destroyed: {costs}"
    for g in groups[8:] + again:
        dist.destroy_process_group(g)


@check("groups", worlds=(3,), skip_on={"gloo": "Gloo does not check that calls match"})
def a_failed_group_leaves_the_others_working(ctx: Ctx):
    """Rank 1 calls all_reduce with another length on one group: every rank's call raises, the
    group stays broken, and a group on the same connections and the default group go on."""
    doomed, sibling = new_group(), new_group()
    expect_group_works(ctx, doomed, sibling)
    t = torch.ones(9 if ctx.rank == 1 else 8)
    try:
        dist.all_reduce(t, group=doomed)
    except RuntimeError as e:
        assert "rustc10d" in str(e), e
    else:
        raise AssertionError("a mismatched all_reduce must raise")
    expect_group_works(ctx, sibling)
    check_group_usable(ctx, "after another group failed")
    try:
        dist.all_reduce(torch.ones(8), group=doomed)
    except RuntimeError as e:
        assert "broken" in str(e), e
    else:
        raise AssertionError("a failed group must stay broken")

# torch 2.11-2.14 split only a default group bound to a device, and bind only accelerators.
NO_CPU_SPLIT = (
    {b: f"torch {torch.__version__} splits only groups bound to an accelerator" for b in ("rustc10d", "gloo")}
    if "not safe to split any process groups" in inspect.getsource(dist.split_group)
    else {}
)


@check("groups", skip_on=NO_CPU_SPLIT)
def split_group(ctx: Ctx):
    """dist.split_group of the world into its lower half and its upper half reversed (a child
    keeps its split's order: the last rank is rank 0 of the upper child), ops on each child
    all in flight together; then a split of [last, 0] alone, from which the other ranks get no
    group (NON_GROUP_MEMBER; None on torch 2.11)."""
    half = (ctx.world + 1) // 2
    lower, upper = list(range(half)), list(range(ctx.world - 1, half - 1, -1))
    child = dist.split_group(split_ranks=[lower, upper], timeout=GROUP_TIMEOUT)
    mine = lower if ctx.rank in lower else upper
    assert dist.get_process_group_ranks(child) == mine, (dist.get_process_group_ranks(child), mine)
    assert dist.get_rank(child) == mine.index(ctx.rank), (dist.get_rank(child), mine)
    expect_group_works(ctx, child)
    ends = [ctx.world - 1, 0]
    pair = dist.split_group(split_ranks=[ends], timeout=GROUP_TIMEOUT)
    if ctx.rank in ends:
        assert dist.get_rank(pair) == ends.index(ctx.rank), (dist.get_rank(pair), ends)
        expect_group_works(ctx, pair)
    else:
        assert pair in (None, dist.GroupMember.NON_GROUP_MEMBER), pair


@check("groups", worlds=(3,), skip_on={"gloo": "torch before 2.15 splits its one backend twice, and the two race"})
def split_once_for_both_devices(ctx: Ctx):
    """ProcessGroup.split_group, as torch's dist.split_group calls it (no bound device needed
    here, so it runs on torch 2.11 too): torch before 2.15 splits once per device type, and
    rustc10d's backend serves CPU and CUDA. The child serves both; rustc10d hands the second
    split the first's child (torch would keep only the first anyway, so what this checks is
    that the child works however torch splits, not the rendezvous the cache saves)."""
    child = dist.group.WORLD.split_group([0, 1], timeout=GROUP_TIMEOUT, group_name=f"split-once-{ctx.world}")
    if ctx.rank > 1:
        assert child is None, child
        return
    cpu, cuda = child._get_backend(torch.device("cpu")), child._get_backend(torch.device("cuda"))
    assert cpu is cuda, (cpu, cuda)
    t = torch.full((3,), float(ctx.rank + 1))
    dist.all_reduce(t, group=child)
    assert t.tolist() == [3.0] * 3, t


@check("groups")
def new_subgroups(ctx: Ctx):
    size = 2 if ctx.world % 2 == 0 else 1
    mine, everyone = dist.new_subgroups(group_size=size, timeout=GROUP_TIMEOUT)
    assert len(everyone) == ctx.world // size, f"{len(everyone)} subgroups of {size}"
    members = dist.get_process_group_ranks(mine)
    assert members == list(range(ctx.rank - ctx.rank % size, ctx.rank - ctx.rank % size + size)), members
    expect_group_works(ctx, mine)


@check("groups")
def sequence_numbers(ctx: Ctx):
    """The group's sequence number (ProcessGroup._get_sequence_number_for_group(), which asks
    the backend) grows with every collective; on a group that has only run collectives, all
    ranks agree on it. (Not on the world group here: Gloo counts p2p ops too, and earlier
    checks sent messages between some ranks only.)"""

    def number(group):
        backend_seq = group._get_backend(torch.device("cpu"))._get_sequence_number_for_group()
        try:
            seq = group._get_sequence_number_for_group()
        except RuntimeError as e:  # torch 2.11 to 2.13 ask only their own backends, not custom ones
            assert "custom does not yet support sequence numbers" in str(e), e
            return backend_seq
        assert seq == backend_seq, f"ProcessGroup says {seq}, its backend {backend_seq}"
        return seq

    def expect_agreed(group, seq, where):
        spread = torch.tensor([seq, -seq], dtype=torch.int64)
        dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=group)
        assert spread.tolist() == [seq, -seq], f"{where}: ranks' sequence numbers range {-spread[1]} .. {spread[0]}"

    fresh = new_group(list(range(ctx.world)))
    for group, agreed in ((dist.group.WORLD, False), (fresh, True)):
        before = number(group)
        dist.broadcast(torch.zeros(3), src=0, group=group)
        after = number(group)
        assert after > before, f"sequence number {before} before a broadcast, {after} after"
        if agreed:
            expect_agreed(group, after, "after a broadcast")
            dist.all_gather_into_tensor(torch.zeros(ctx.world), torch.ones(1), group=group)
            expect_agreed(group, number(group), "after two more collectives")


# Before torch 2.14, dist.monitored_barrier refuses every backend but Gloo (a ValueError).
NO_MONITORED_BARRIER = (
    {"rustc10d": f"torch {torch.__version__}'s dist.monitored_barrier accepts only Gloo"}
    if "only implemented for GLOO" in inspect.getsource(dist.monitored_barrier)
    else {}
)

# torch's own wording of monitored_barrier and timeout failures (ProcessGroupGloo's), which
# torch's tests and users' tooling match on: Gloo passes these checks as they are.
MISSING_RANK = r"\[Rank 0\]: Rank {ranks} failed to pass monitoredBarrier in {ms} ms"
MISSING_RANKS = r"\[Rank 0\]: Ranks {ranks} failed to pass monitoredBarrier in {ms} ms"
RANK0_TIMED_OUT = r"Rank 0 timed out in monitoredBarrier after 0 ms\.\nNo ranks successfully processed"
REACHED = r"Rank {rank} successfully reached monitoredBarrier, but received errors"
TIMED_OUT = r" (Timed out|closed|timeout) "  # torch's DistributedTest._test_barrier_timeout


def _raises(fn, pattern: str, within: tuple[float, float], what: str) -> str:
    """fn() must raise a RuntimeError matching `pattern` (re.search) after `within` seconds."""
    t0 = time.monotonic()
    try:
        fn()
    except RuntimeError as e:
        waited, msg = time.monotonic() - t0, str(e)
        assert re.search(pattern, msg), f"{what}: error does not match {pattern!r}: {msg!r}"
        assert within[0] <= waited <= within[1], f"{what}: raised after {waited:.2f} s, not in {within}: {msg}"
        return msg
    raise AssertionError(f"{what}: returned, expected an error matching {pattern!r}")


@check("groups", skip_on=NO_MONITORED_BARRIER)
def monitored_barrier_passes(ctx: Ctx):
    """With every rank there it returns, also when one rank comes late, and not before it does."""
    late = 0.5
    for _ in range(2):
        if ctx.rank == ctx.world - 1:
            time.sleep(late)
        t0 = time.monotonic()
        dist.monitored_barrier(timeout=timedelta(seconds=20), wait_all_ranks=True)
        waited = time.monotonic() - t0
        if ctx.rank == 0:
            assert waited > late / 2, f"monitored_barrier returned after {waited:.2f} s, before the last rank came"


@check("groups", skip_on=NO_MONITORED_BARRIER)
def monitored_barrier_names_missing_ranks(ctx: Ctx):
    """The odd ranks never enter: rank 0 raises at about the timeout, naming each of them in
    torch's words (wait_all_ranks=True lists them all, else the first), and the other even
    ranks raise too. Done on groups made for it and then dropped, so what is left of the failed
    barrier cannot reach later checks. Their timeout bounds how long Gloo's non-zero ranks wait
    (they wait with the group's timeout); rustc10d's rank 0 tells them at once."""
    timeout = 2  # s
    missing = [r for r in range(ctx.world) if r % 2]
    for wait_all in (True, False):
        group = dist.new_group(list(range(ctx.world)), timeout=timedelta(seconds=4 * timeout))
        if ctx.rank == 0:
            form = MISSING_RANKS if wait_all else MISSING_RANK
            ranks = ", ".join(map(str, missing if wait_all else missing[:1]))
            _raises(lambda: dist.monitored_barrier(group, timeout=timedelta(seconds=timeout), wait_all_ranks=wait_all),
                    form.format(ranks=ranks, ms=timeout * 1000), (timeout / 2, timeout + 15),
                    f"monitored_barrier(wait_all_ranks={wait_all}) on rank 0")
        elif ctx.rank not in missing:
            pattern = REACHED.format(rank=ctx.rank) if ctx.backend == "rustc10d" else "."
            _raises(lambda: dist.monitored_barrier(group, timeout=timedelta(seconds=timeout), wait_all_ranks=wait_all),
                    pattern, (0, 4 * timeout + 15), f"monitored_barrier(wait_all_ranks={wait_all}) on rank {ctx.rank}")
    check_group_usable(ctx, "after a failed monitored_barrier on another group")


@check("groups", skip_on=NO_MONITORED_BARRIER)
def monitored_barrier_zero_timeout_fails_at_once(ctx: Ctx):
    """timedelta(0) is a timeout of zero, not "no timeout given": rank 0 raises at once in
    torch's words, before any rank could have arrived."""
    group = dist.new_group(list(range(ctx.world)), timeout=timedelta(seconds=3))
    zero = timedelta(0)
    if ctx.rank == 0:
        _raises(lambda: dist.monitored_barrier(group, timeout=zero), RANK0_TIMED_OUT, (0, 1), "rank 0")
    else:
        # rustc10d: told by rank 0 at once; Gloo: at the group's timeout.
        pattern = REACHED.format(rank=ctx.rank) if ctx.backend == "rustc10d" else "."
        _raises(lambda: dist.monitored_barrier(group, timeout=zero), pattern, (0, 3 + 10), f"rank {ctx.rank}")
    check_group_usable(ctx, "after a monitored_barrier with a zero timeout")


@check("groups")
def barrier_timeout_says_timed_out(ctx: Ctx):
    """Only rank 0 enters a barrier: it raises no earlier than the group's timeout (less
    torch's 0.1 s of slack), with "Timed out" in the text, as torch's own barrier timeout test
    expects. The group is then dropped (it is out of step)."""
    timeout = 1.5
    group = dist.new_group(list(range(ctx.world)), timeout=timedelta(seconds=timeout))
    if ctx.rank == 0:
        msg = _raises(lambda: dist.barrier(group), TIMED_OUT, (timeout - 0.1, timeout + 10), "barrier")
        detail = r"rustc10d: Timed out after 1500 ms: barrier #\d+ on rank 0 was waiting (for data from|for a send to|in the shared arena for) rank"
        assert ctx.backend != "rustc10d" or re.search(detail, msg), msg
    dist.barrier()  # the others wait for rank 0 here, in the default group
    check_group_usable(ctx, "after a barrier timed out on another group")
