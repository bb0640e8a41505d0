"""Issuing the differential suite's legal calls (diff_calls.py) and checking their results
against arithmetic (diff_tensors.py). The illegal ones are in diff_bad.py.

Each op's issue function runs on every member of the call's group, issues the call the way
torch users do, and returns (handle, verify): handle is what torch returned (waited on by
checks.wait_done), verify() notes what is wrong once it has been waited on. Problems are noted,
never raised mid-call: the other ranks would be left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import random
import zlib

import torch
import torch.distributed as dist

from checks import BACKEND
from diff_calls import Call
from diff_tensors import Inputs, expect_close, expect_reduced, expect_same, make, place, unchanged


def reduce_op(name: str, factor: float | None):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(factor)
    return getattr(dist.ReduceOp, name)


class Env:
    """One call as this rank, a member of its group, sees it."""

    def __init__(self, rank: int, call: Call, pg):
        self.rank, self.call, self.pg = rank, call, pg  # pg None: the default (world) group
        self.members = list(call.ranks)
        self.n = len(self.members)
        self.me = self.members.index(rank)
        self.inp = Inputs(call)
        self.problems: list[str] = []
        self._placed = []  # (role, Placed)
        self._readonly = []  # (role, tensor, its values before the op)

    def note(self, problem: str | None):
        if problem:
            self.problems.append(problem)

    def put(self, values: torch.Tensor, role: str, readonly=False, layout=None) -> torch.Tensor:
        """`values` in the call's layout; `readonly`: the op must not change it."""
        placed = place(values, layout or self.call.layout, f"{self.inp.key}|{role}|{self.rank}")
        self._placed.append((role, placed))
        if readonly:
            self._readonly.append((role, placed.view, placed.view.clone()))
        return placed.view

    def check_untouched(self):
        """Storage around every tensor, and every input, as it was."""
        for role, placed in self._placed:
            self.note(placed.outside_changed(role))
        for role, live, before in self._readonly:
            self.note(unchanged(live, before, f"{role} (an input) after the op"))

    def garbage(self, shape, role="out", dtype=None) -> torch.Tensor:
        return self.inp.garbage(self.rank, shape, dtype, role=f"garbage {role}")

    def rooted(self, global_name: str, group_name: str, rank=None) -> dict:
        """The keyword naming the root (or peer) `rank`: a global rank, or its group rank."""
        rank = self.call.root if rank is None else rank
        return {group_name: self.members.index(rank)} if self.call.by_group_rank else {global_name: rank}

    def op(self):
        factor = self.call.factor
        if self.call.param("factor_as") == "tensor":  # of the call's dtype, as NCCL wants it
            dtype = self.call.dtype.to_real() if self.call.dtype.is_complex else self.call.dtype
            factor = torch.tensor([factor], dtype=dtype)
        return reduce_op(self.call.reduce_op, factor)


# ----------------------------------------------------------------------------- collectives


def _all_reduce(env: Env):
    c = env.call
    ins = [env.inp.of(r) for r in env.members]
    t = env.put(ins[env.me], "tensor")
    work = dist.all_reduce(t, op=env.op(), group=env.pg, async_op=c.async_op)
    return work, lambda: env.note(expect_reduced(t, ins, c.reduce_op, c.factor, "all_reduce result"))


def _reduce(env: Env):
    c = env.call
    ins = [env.inp.of(r) for r in env.members]
    root = env.rank == c.root
    # rustc10d leaves the other ranks' tensors as they were (README); Gloo uses them as scratch
    t = env.put(ins[env.me], "tensor", readonly=not root and BACKEND == "rustc10d")
    work = dist.reduce(t, op=env.op(), group=env.pg, async_op=c.async_op, **env.rooted("dst", "group_dst"))

    def verify():
        if root:
            env.note(expect_reduced(t, ins, c.reduce_op, c.factor, "reduce result at the root"))

    return work, verify


def _broadcast(env: Env):
    c = env.call
    sent = env.inp.of(c.root)
    t = env.put(sent if env.rank == c.root else env.garbage(c.shape), "tensor")
    work = dist.broadcast(t, group=env.pg, async_op=c.async_op, **env.rooted("src", "group_src"))
    return work, lambda: env.note(expect_same(t, sent, "broadcast result"))


def _all_gather(env: Env):
    c = env.call
    ins = [env.inp.of(r) for r in env.members]
    x = env.put(ins[env.me], "input", readonly=True)
    outs = [env.put(env.garbage(c.shape, f"out{j}"), f"output {j}") for j in range(env.n)]
    work = dist.all_gather(outs, x, group=env.pg, async_op=c.async_op)

    def verify():
        for j, (got, want) in enumerate(zip(outs, ins)):
            env.note(expect_same(got, want, f"all_gather output {j}"))

    return work, verify


def _stacked(env: Env, shape) -> tuple[int, ...]:
    """n blocks of `shape` along dim 0 ("cat") or a new leading dim ("stack")."""
    return (env.n * shape[0], *shape[1:]) if env.call.param("form") == "cat" else (env.n, *shape)


def _shared(env: Env) -> bool:
    """Whether this call's input and output are views of one tensor (diff_calls.SHARING_OPS);
    rustc10d only: Gloo gets all_to_all_single(t, t) wrong."""
    return env.call.param("memory") == "shared" and BACKEND == "rustc10d"


def _block(env: Env, t: torch.Tensor, j: int) -> torch.Tensor:
    """Member j's block of a tensor of n blocks (_stacked)."""
    if env.call.param("form") == "cat":
        rows = t.shape[0] // env.n
        return t[j * rows:(j + 1) * rows]
    return t[j]


def _all_gather_into_tensor(env: Env):
    c = env.call
    ins = [env.inp.of(r) for r in env.members]
    out = env.put(env.garbage(_stacked(env, c.shape)), "output")
    if _shared(env):  # the input is the next member's block of the output
        x = _block(env, out, (env.me + 1) % env.n)
        x.copy_(ins[env.me])
    else:
        x = env.put(ins[env.me], "input", readonly=True)
    work = dist.all_gather_into_tensor(out, x, group=env.pg, async_op=c.async_op)
    want = torch.cat(ins) if c.param("form") == "cat" else torch.stack(ins)
    return work, lambda: env.note(expect_same(out, want, "all_gather_into_tensor output"))


def _reduce_scatter(env: Env):
    c = env.call
    mine = [env.put(env.inp.of(env.rank, f"to {j}"), f"input {j}", readonly=True) for j in range(env.n)]
    out = env.put(env.garbage(c.shape), "output")
    work = dist.reduce_scatter(out, mine, op=env.op(), group=env.pg, async_op=c.async_op)
    to_me = [env.inp.of(r, f"to {env.me}") for r in env.members]
    return work, lambda: env.note(expect_reduced(out, to_me, c.reduce_op, c.factor, "reduce_scatter output"))


def _reduce_scatter_tensor(env: Env):
    c = env.call
    full_shape = _stacked(env, c.shape)
    full = [env.inp.of(r, shape=full_shape) for r in env.members]
    if _shared(env):  # the output is the next member's block of the input
        x = env.put(full[env.me], "input")
        out = _block(env, x, (env.me + 1) % env.n)
    else:
        x = env.put(full[env.me], "input", readonly=True)
        out = env.put(env.garbage(c.shape), "output")
    work = dist.reduce_scatter_tensor(out, x, op=env.op(), group=env.pg, async_op=c.async_op)
    to_me = [f.reshape(env.n, *c.shape)[env.me] for f in full]
    return work, lambda: env.note(expect_reduced(out, to_me, c.reduce_op, c.factor, "reduce_scatter_tensor output"))


def _gather(env: Env):
    c = env.call
    ins = [env.inp.of(r) for r in env.members]
    x = env.put(ins[env.me], "input", readonly=True)
    root = env.rank == c.root
    outs = [env.put(env.garbage(c.shape, f"out{j}"), f"output {j}") for j in range(env.n)] if root else None
    work = dist.gather(x, outs, group=env.pg, async_op=c.async_op, **env.rooted("dst", "group_dst"))

    def verify():
        for j, got in enumerate(outs or []):
            env.note(expect_same(got, ins[j], f"gather output {j} at the root"))

    return work, verify


def _scatter(env: Env):
    c = env.call
    chunks = [env.inp.of(c.root, f"to {j}") for j in range(env.n)]
    ins = [env.put(ch, f"input {j}", readonly=True) for j, ch in enumerate(chunks)] if env.rank == c.root else None
    out = env.put(env.garbage(c.shape), "output")
    work = dist.scatter(out, ins, group=env.pg, async_op=c.async_op, **env.rooted("src", "group_src"))
    return work, lambda: env.note(expect_same(out, chunks[env.me], "scatter output"))


def _blocks(env: Env):
    """all_to_all's blocks: (what this rank sends each member, what it must receive from each)."""
    c, rows = env.call, env.call.param("rows")

    def block(i, j):  # from member i to member j
        return env.inp.of(env.members[i], f"to {j}", (rows[i][j], *c.shape[1:]))

    return [block(env.me, j) for j in range(env.n)], [block(i, env.me) for i in range(env.n)]


def _all_to_all_single(env: Env):
    c, rows = env.call, env.call.param("rows")
    sends, wants = _blocks(env)
    want = torch.cat(wants)
    if _shared(env) and want.shape == torch.cat(sends).shape:  # in place
        x = out = env.put(torch.cat(sends), "input and output")
    else:
        x = env.put(torch.cat(sends), "input", readonly=True)
        out = env.put(env.garbage(want.shape), "output")
    splits = {}
    if not (c.param("split") == "even" and c.param("split_sizes") == "none"):
        splits = {"output_split_sizes": [rows[i][env.me] for i in range(env.n)],
                  "input_split_sizes": list(rows[env.me])}
    work = dist.all_to_all_single(out, x, group=env.pg, async_op=c.async_op, **splits)
    return work, lambda: env.note(expect_same(out, want, "all_to_all_single output"))


def _all_to_all(env: Env):
    sends, wants = _blocks(env)
    xs = [env.put(s, f"input {j}", readonly=True) for j, s in enumerate(sends)]
    outs = [env.put(env.garbage(w.shape, f"out{i}"), f"output {i}") for i, w in enumerate(wants)]
    work = dist.all_to_all(outs, xs, group=env.pg, async_op=env.call.async_op)

    def verify():
        for i, (got, want) in enumerate(zip(outs, wants)):
            env.note(expect_same(got, want, f"all_to_all output {i}"))

    return work, verify


def _barrier(env: Env):
    return dist.barrier(group=env.pg, async_op=env.call.async_op), lambda: None


# ----------------------------------------------------------------------------- point to point


def _send_recv(env: Env):
    """One message from `src` to `dst`; the other members do nothing."""
    c = env.call
    src, dst, how, tag = (c.param(k) for k in ("src", "dst", "how", "tag"))
    sent = env.inp.of(src)
    if env.rank == src:
        x = env.put(sent, "sent", readonly=True)
        if how == "async":
            return dist.isend(x, group=env.pg, tag=tag, **env.rooted("dst", "group_dst", dst)), lambda: None
        dist.send(x, group=env.pg, tag=tag, **env.rooted("dst", "group_dst", dst))
        return None, lambda: None
    if env.rank != dst:
        return None, lambda: None
    buf = env.put(env.garbage(c.shape), "received")
    if how == "async":
        return dist.irecv(buf, group=env.pg, tag=tag, **env.rooted("src", "group_src", src)), \
            lambda: env.note(expect_same(buf, sent, "received message"))
    if how == "recv_any":
        sender = dist.recv(buf, group=env.pg, tag=tag)
    else:
        sender = dist.recv(buf, group=env.pg, tag=tag, **env.rooted("src", "group_src", src))
    if sender != src:
        env.note(f"recv returned sender {sender}, expected {src}")
    return None, lambda: env.note(expect_same(buf, sent, "received message"))


def _isend_irecv(env: Env):
    """A ring over the members: isend to the next, irecv from the previous."""
    c = env.call
    nxt, prv = env.members[(env.me + 1) % env.n], env.members[(env.me - 1) % env.n]
    x = env.put(env.inp.of(env.rank, "ring"), "sent", readonly=True)
    buf = env.put(env.garbage(c.shape), "received")
    tag = c.param("tag")
    send = lambda: dist.isend(x, group=env.pg, tag=tag, **env.rooted("dst", "group_dst", nxt))  # noqa: E731
    recv = lambda: dist.irecv(buf, group=env.pg, tag=tag, **env.rooted("src", "group_src", prv))  # noqa: E731
    works = [send(), recv()] if c.param("order") == "sends_first" else [recv(), send()]
    return works, lambda: env.note(expect_same(buf, env.inp.of(prv, "ring"), f"message from rank {prv}"))


def _batch_isend_irecv(env: Env):
    """One batch per rank: to and from every other member ("all_pairs"), or two messages to
    the next member and two from the previous ("ring"); the batch's order is shuffled per
    rank, keeping the order of the messages between one pair (they match in posting order)."""
    c = env.call
    if c.param("pattern") == "all_pairs":
        peers = [(q, q) for q in env.members if q != env.rank]  # (send to, receive from)
    else:
        nxt, prv = env.members[(env.me + 1) % env.n], env.members[(env.me - 1) % env.n]
        peers = [(nxt, prv), (nxt, prv)]
    items = [("send", to) for to, _ in peers] + [("recv", frm) for _, frm in peers]
    random.Random(f"{env.inp.key}|order|{env.rank}").shuffle(items)
    ops, checks, count = [], [], {}
    for kind, peer in items:
        k = count[kind, peer] = count.get((kind, peer), -1) + 1  # the k-th message between the pair
        peer_kw = {"group_peer": env.members.index(peer)} if c.by_group_rank else {"peer": peer}
        if kind == "send":
            x = env.put(env.inp.of(env.rank, f"to {peer} #{k}"), f"sent to {peer} #{k}", readonly=True)
            ops.append(dist.P2POp(dist.isend, x, group=env.pg, **peer_kw))
        else:
            buf = env.put(env.garbage(c.shape, f"from {peer} #{k}"), f"received from {peer} #{k}")
            ops.append(dist.P2POp(dist.irecv, buf, group=env.pg, **peer_kw))
            checks.append((buf, env.inp.of(peer, f"to {env.rank} #{k}"), f"message #{k} from rank {peer}"))
    with undoing_coalescing(env.pg):
        works = dist.batch_isend_irecv(ops)
    return works, lambda: [env.note(expect_same(b, w, where)) for b, w, where in checks]


@contextlib.contextmanager
def undoing_coalescing(pg):
    """torch's _coalescing_manager (under batch_isend_irecv) has no try/finally: an op that
    raises inside it leaves the group coalescing, in torch's Python (every later collective on
    the group is queued there, silently never issued) and in the backend. Undo both, so a
    failed batch costs its own call, not every later one on the group."""
    try:
        yield
    except BaseException:
        group = pg or dist.group.WORLD
        if dist.distributed_c10d._world.pg_coalesce_state.pop(group, None) is not None:
            try:
                group._end_coalescing(torch.device("cpu"))
            except Exception:  # noqa: BLE001 (the original error is the one to report)
                pass
        raise


# ----------------------------------------------------------------------------- sparse, coalesced


def sparse_input(env: Env, member: int, shape=None) -> torch.Tensor:
    """Member `member`'s sparse COO tensor, in the call's form: coalesced, uncoalesced (rows
    repeated), overlapping (every rank the same indices), empty (no rows on odd members),
    hybrid (one sparse dimension, rows of a dense part)."""
    c = env.call
    shape = shape or c.shape
    form = c.param("form")
    rank = env.members[member]
    sparse_dims = 1 if form == "hybrid" else len(shape)
    index_key = f"{env.inp.key}|sparse indices|{'all' if form == 'overlapping' else rank}"
    g = torch.Generator().manual_seed(zlib.crc32(index_key.encode()))
    nnz = 0 if form == "empty" and member % 2 else int(torch.randint(1, 13, (), generator=g))
    idx = torch.stack([torch.randint(0, shape[d], (nnz,), generator=g) for d in range(sparse_dims)]) \
        if sparse_dims else torch.zeros((0, nnz), dtype=torch.long)
    if form == "uncoalesced" and nnz:
        idx = torch.cat([idx, idx[:, : max(1, nnz // 2)]], 1)
    vals = make(f"{env.inp.key}|sparse values|{rank}", (idx.shape[1], *shape[sparse_dims:]), c.dtype, "SUM")
    t = torch.sparse_coo_tensor(idx, vals, shape)
    return t.coalesce() if form == "coalesced" else t


def expect_sparse_sum(t, inputs, where) -> str | None:
    if t.layout != torch.sparse_coo:
        return f"{where}: layout {t.layout}, expected sparse COO"
    if not t.is_coalesced():
        wrong = expect_sparse_sum(t.coalesce(), inputs, where)
        return f"{where}: the result is not coalesced (nnz {t._nnz()}); coalesced, {wrong or 'its values are right'}"
    dtype = inputs[0].dtype
    dense = [x.to_dense() for x in inputs]
    if dtype == torch.bool:
        return expect_same(t.to_dense(), torch.stack(dense).any(0), where)
    if dtype.is_floating_point:
        want = torch.stack([d.double() for d in dense]).sum(0)
        # each rank's own repeated rows are added up too: up to twice as many terms
        return expect_close(t.to_dense(), want, dtype, 2 * len(inputs), where)
    return expect_same(t.to_dense(), torch.stack([d.long() for d in dense]).sum(0).to(dtype), where)


def _sparse_all_reduce(env: Env):
    c = env.call
    ins = [sparse_input(env, i) for i in range(env.n)]
    t = sparse_input(env, env.me)
    work = dist.all_reduce(t, group=env.pg, async_op=c.async_op)
    return work, lambda: env.note(expect_sparse_sum(t, ins, "sparse all_reduce result"))


def _all_reduce_coalesced(env: Env):
    c = env.call
    ins = [[env.inp.of(r, f"tensor {i}", s) for r in env.members] for i, s in enumerate(c.param("shapes"))]
    ts = [per_rank[env.me].clone() for per_rank in ins]
    handle = dist.all_reduce_coalesced(ts, op=env.op(), group=env.pg, async_op=c.async_op)

    def verify():
        for i, (t, per_rank) in enumerate(zip(ts, ins)):
            env.note(expect_reduced(t, per_rank, c.reduce_op, c.factor, f"all_reduce_coalesced tensor {i}"))

    return handle, verify


def _coalescing_manager(env: Env):
    """Several ops of one kind in dist._coalescing_manager: one coalesced call to the backend."""
    c = env.call
    inner = c.param("inner")
    verifies = []
    with undoing_coalescing(env.pg), dist._coalescing_manager(group=env.pg, async_ops=c.async_op) as cm:
        for i, s in enumerate(c.param("shapes")):
            if inner == "all_reduce":
                ins = [env.inp.of(r, f"tensor {i}", s) for r in env.members]
                t = ins[env.me].clone()
                dist.all_reduce(t, op=env.op(), group=env.pg)
                verifies.append(lambda t=t, ins=ins, i=i: expect_reduced(t, ins, c.reduce_op, c.factor, f"tensor {i}"))
            elif inner == "all_gather_into_tensor":
                ins = [env.inp.of(r, f"tensor {i}", s) for r in env.members]
                out = env.garbage((env.n * s[0], *s[1:]), f"out{i}")
                dist.all_gather_into_tensor(out, ins[env.me], group=env.pg)
                verifies.append(lambda out=out, ins=ins, i=i: expect_same(out, torch.cat(ins), f"output {i}"))
            else:
                full = [env.inp.of(r, f"tensor {i}", (env.n * s[0], *s[1:])) for r in env.members]
                out = env.garbage(s, f"out{i}")
                dist.reduce_scatter_tensor(out, full[env.me], op=env.op(), group=env.pg)
                to_me = [f.reshape(env.n, *s)[env.me] for f in full]
                verifies.append(lambda out=out, to_me=to_me, i=i: expect_reduced(out, to_me, c.reduce_op, c.factor,
                                                                                 f"output {i}"))
    return (cm if c.async_op else None), lambda: [env.note(v()) for v in verifies]


ISSUE = {
    "all_reduce": _all_reduce, "reduce": _reduce, "broadcast": _broadcast, "all_gather": _all_gather,
    "all_gather_into_tensor": _all_gather_into_tensor, "reduce_scatter": _reduce_scatter,
    "reduce_scatter_tensor": _reduce_scatter_tensor, "gather": _gather, "scatter": _scatter,
    "all_to_all_single": _all_to_all_single, "all_to_all": _all_to_all, "barrier": _barrier,
    "send_recv": _send_recv, "isend_irecv": _isend_irecv, "batch_isend_irecv": _batch_isend_irecv,
    "sparse_all_reduce": _sparse_all_reduce, "all_reduce_coalesced": _all_reduce_coalesced,
    "coalescing_manager": _coalescing_manager,
}
