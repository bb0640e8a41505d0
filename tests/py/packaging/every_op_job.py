"""Every torch.distributed op once, checked against arithmetic: the job that each torch of the
supported range runs (scripts/torch_matrix.sh), and pytest too (test_example.py).

    torchrun --nproc-per-node 2 tests/py/packaging/every_op_job.py
    RUSTC10D_TEST_STAGING=1 torchrun --nproc-per-node 2 tests/py/packaging/every_op_job.py   # staged like CUDA

Rank 0 prints one line per op and then "OK" when every rank got what it expected; the job exits
non-zero otherwise. An op this torch does not offer is listed as skipped, never faked. The
payloads are small: this checks that every op works on this torch, not every size or dtype
(tests/checks*.py do that).
"""

from __future__ import annotations

import inspect
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

OPS = {}  # name -> fn(rank, world) that raises AssertionError on a wrong result


def op(fn):
    OPS[fn.__name__] = fn
    return fn


def expect(got: torch.Tensor, want: torch.Tensor, what: str):
    assert torch.equal(got, want), f"{what}: got {got.tolist()}, expected {want.tolist()}"


def mine(rank: int, n: int = 4, dtype=torch.float32) -> torch.Tensor:
    """Rank r's input: r * 10 + [0, 1, ...], exact in every dtype used here."""
    return (torch.arange(n) + rank * 10).to(dtype)


@op
def all_reduce(rank, world):
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.bool):
        t = mine(rank, dtype=dtype) if dtype != torch.bool else torch.tensor([rank == 0, True, False, False])
        dist.all_reduce(t)
        want = sum(mine(r, dtype=torch.float64) for r in range(world)).to(dtype)
        if dtype == torch.bool:
            want = torch.tensor([True, True, False, False])
        expect(t, want, f"all_reduce {dtype}")
    big = torch.ones(100_003)  # the ring rather than the direct exchange
    dist.all_reduce(big, op=dist.ReduceOp.MAX)
    expect(big, torch.ones(100_003), "all_reduce MAX, large")
    t = mine(rank)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
    expect(t, 2 * sum(mine(r) for r in range(world)), "all_reduce PREMUL_SUM")


@op
def all_reduce_sparse(rank, world):
    # Index 0 on every rank, and twice on rank 0 (uncoalesced): rows with equal indices add up.
    t = torch.sparse_coo_tensor([[0, rank]], [1.0, 1.0], (world,))
    dist.all_reduce(t)
    expected = torch.ones(world)
    expected[0] += world
    expect(t.to_dense(), expected, "sparse all_reduce")


@op
def all_reduce_coalesced(rank, world):
    ts = [mine(rank), mine(rank, 3)]
    dist.all_reduce_coalesced(ts)
    expect(ts[1], sum(mine(r, 3) for r in range(world)), "all_reduce_coalesced")


@op
def reduce(rank, world):
    t = mine(rank)
    dist.reduce(t, dst=world - 1)
    expect(t, sum(mine(r) for r in range(world)) if rank == world - 1 else mine(rank), "reduce")


@op
def broadcast(rank, world):
    t = mine(rank)
    dist.broadcast(t, src=world - 1)
    expect(t, mine(world - 1), "broadcast")


@op
def all_gather(rank, world):
    outs = [torch.zeros(4) for _ in range(world)]
    dist.all_gather(outs, mine(rank))
    expect(torch.stack(outs), torch.stack([mine(r) for r in range(world)]), "all_gather")


@op
def all_gather_into_tensor(rank, world):
    out = torch.zeros(4 * world)
    dist.all_gather_into_tensor(out, mine(rank))
    expect(out, torch.cat([mine(r) for r in range(world)]), "all_gather_into_tensor")


@op
def all_gather_coalesced(rank, world):
    outs = [[torch.zeros(4)] for _ in range(world)]
    dist.all_gather_coalesced(outs, [mine(rank)])
    expect(torch.stack([o[0] for o in outs]), torch.stack([mine(r) for r in range(world)]), "all_gather_coalesced")


@op
def gather(rank, world):
    outs = [torch.zeros(4) for _ in range(world)] if rank == 0 else None
    dist.gather(mine(rank), outs, dst=0)
    if rank == 0:
        expect(torch.stack(outs), torch.stack([mine(r) for r in range(world)]), "gather")


@op
def gather_into_tensor(rank, world):
    if not hasattr(dist, "gather_into_tensor"):
        return "skipped: this torch has no dist.gather_into_tensor"
    out = torch.zeros(4 * world) if rank == 0 else None
    dist.gather_into_tensor(mine(rank), out, dst=0)
    if rank == 0:
        expect(out, torch.cat([mine(r) for r in range(world)]), "gather_into_tensor")


@op
def scatter(rank, world):
    out = torch.zeros(4)
    dist.scatter(out, [mine(r) for r in range(world)] if rank == 0 else None, src=0)
    expect(out, mine(rank), "scatter")


@op
def reduce_scatter(rank, world):
    out = torch.zeros(4)
    dist.reduce_scatter(out, [mine(rank) + r for r in range(world)])
    expect(out, sum(mine(r) + rank for r in range(world)), "reduce_scatter")


@op
def reduce_scatter_tensor(rank, world):
    out = torch.zeros(2)
    dist.reduce_scatter_tensor(out, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
    want = torch.arange(2 * world, dtype=torch.float32)[2 * rank:2 * rank + 2] * sum(range(1, world + 1))
    expect(out, want, "reduce_scatter_tensor")


@op
def all_to_all(rank, world):
    outs = [torch.zeros(2) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((2,), float(rank * world + r)) for r in range(world)])
    expect(torch.stack(outs), torch.stack([torch.full((2,), float(r * world + rank)) for r in range(world)]),
           "all_to_all")


@op
def all_to_all_single(rank, world):
    out = torch.zeros(world)
    dist.all_to_all_single(out, torch.arange(world, dtype=torch.float32) + rank * world)
    expect(out, torch.tensor([float(r * world + rank) for r in range(world)]), "all_to_all_single")


@op
def coalescing_manager(rank, world):
    # One kind of collective per coalesced call, as torch requires.
    a, b = mine(rank), mine(rank, 3)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    expect(b, sum(mine(r, 3) for r in range(world)), "coalesced all_reduce")
    outs = [torch.zeros(4 * world), torch.zeros(4 * world)]
    with dist._coalescing_manager():
        for o in outs:
            dist.all_gather_into_tensor(o, mine(rank))
    expect(outs[1], torch.cat([mine(r) for r in range(world)]), "coalesced all_gather_into_tensor")
    outs = [torch.zeros(1), torch.zeros(1)]
    with dist._coalescing_manager():
        for o in outs:
            dist.reduce_scatter_tensor(o, torch.ones(world))
    expect(torch.cat(outs), torch.full((2,), float(world)), "coalesced reduce_scatter_tensor")


@op
def send_recv(rank, world):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    send = dist.isend(mine(rank), dst=nxt, tag=7)
    got = torch.zeros(4)
    dist.recv(got, src=prv, tag=7)
    send.wait()
    expect(got, mine(prv), "isend/recv")
    if rank == 0:
        dist.send(mine(rank), dst=1)
    elif rank == 1:
        got = torch.zeros(4)
        assert dist.recv(got) == 0, "recv from any source names its sender"
        expect(got, mine(0), "send/recv from any source")


@op
def batch_isend_irecv(rank, world):
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    got = torch.zeros(4)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine(rank), nxt), dist.P2POp(dist.irecv, got, prv)])
    for w in works:
        w.wait()
    expect(got, mine(prv), "batch_isend_irecv")


@op
def barrier(rank, world):
    dist.barrier()


@op
def monitored_barrier(rank, world):
    if "only implemented for GLOO" in inspect.getsource(dist.monitored_barrier):
        return "skipped: this torch's dist.monitored_barrier accepts only Gloo"
    dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)


@op
def object_collectives(rank, world):
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in range(world)], f"all_gather_object: {objs}"
    lst = [f"from {rank}"]
    dist.broadcast_object_list(lst, src=0)
    assert lst == ["from 0"], f"broadcast_object_list: {lst}"


@op
def new_group(rank, world):
    group = dist.new_group(list(range(world)))
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    expect(t, torch.full((2,), float(world)), "all_reduce on a new group")
    dist.destroy_process_group(group)


@op
def split_group(rank, world):
    """Splits of the world: a group per rank, then one of every rank in reverse order (a child
    keeps its split's order: rank r is rank W - 1 - r of it)."""
    if "not safe to split any process groups" in inspect.getsource(dist.split_group):
        return "skipped: this torch splits only groups bound to an accelerator"
    child = dist.split_group(split_ranks=[[r] for r in reversed(range(world))])
    assert dist.get_process_group_ranks(child) == [rank], dist.get_process_group_ranks(child)
    whole = dist.split_group(split_ranks=[list(reversed(range(world)))])
    assert dist.get_rank(whole) == world - 1 - rank, dist.get_rank(whole)
    t = torch.ones(2) * (rank + 1)
    dist.all_reduce(t, group=whole)
    expect(t, torch.full((2,), float(world * (world + 1) // 2)), "all_reduce on a split group")
    dist.destroy_process_group(whole)
    dist.destroy_process_group(child)


def main() -> int:
    import rustc10d  # noqa: F401

    dist.init_process_group(backend="rustc10d", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    failed, skipped = [], []
    for name, fn in OPS.items():
        try:
            note = fn(rank, world)
        except Exception as e:  # one op's failure is reported, and the others still run
            failed.append(f"{name}: {type(e).__name__}: {e}")
            continue
        if note:
            skipped.append(f"{name} ({note})")
    ok = torch.tensor([0 if failed else 1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    for line in failed:
        print(f"[rank {rank}] FAILED {line}", flush=True)
    if rank == 0:
        print(f"torch {torch.__version__}: {len(OPS) - len(skipped)} ops checked; skipped: {skipped or 'none'}",
              flush=True)
    dist.destroy_process_group()
    if ok.item() != 1:
        return 1
    if rank == 0:
        print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
