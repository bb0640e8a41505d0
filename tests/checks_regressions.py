"""Named regression checks: each is a case a user hit, or the differential suite found, that the
checks before it did not cover. Run by the main job (suite "collectives"), so over shared memory,
TCP and staged like CUDA tensors, at every world size. Each docstring says what was wrong.
"""

from __future__ import annotations

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
