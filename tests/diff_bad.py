"""Issuing the differential suite's illegal calls (diff_calls.py, kinds "local" and "mismatch").

A "local" call is one every rank that makes it can see is wrong: it must raise a RuntimeError
(or ValueError) naming rustc10d at issue, before anything leaves the rank, change no tensor,
and leave the group usable (a small all_reduce on it right after must work). Some are made
through the backend object (ProcessGroup._get_backend), where torch's own Python or dispatcher
would refuse first (a sparse tensor to broadcast, a send to the own rank), as C++ callers
reach it.

A "mismatch" is legal on each rank but the ranks disagree: every member must raise, naming
"does not match", and no tensor may change. It runs on a group made for it, which it breaks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from checks import BACKEND
from diff_run import Env, reduce_op
from diff_tensors import unchanged

# same size, another dtype: a call that reinterprets bytes would not notice
OTHER_DTYPE = {torch.float32: torch.int32, torch.int32: torch.float32, torch.float64: torch.int64,
               torch.int64: torch.float64, torch.bfloat16: torch.float16, torch.float16: torch.bfloat16}


class Bad:
    """What one rank does for an illegal call: `fn` (None: this rank makes no call) and the
    tensors it must leave as they were."""

    def __init__(self, env: Env):
        self.env = env
        self.fn = None
        self.watched: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def t(self, role: str, shape=None, dtype=None) -> torch.Tensor:
        """A tensor of this rank's, watched."""
        t = self.env.inp.of(self.env.rank, role, shape, dtype)
        self.watched.append((role, t, t.clone()))
        return t

    def sparse(self, role: str, size: int) -> torch.Tensor:
        t = torch.sparse_coo_tensor([[0]], torch.ones(1, dtype=self.env.call.dtype), (size,))
        self.watched.append((role, t, t.clone()))
        return t

    def changed(self) -> list[str]:
        return [p for role, live, before in self.watched if (p := unchanged(live, before, role))]


def backend_of(pg):
    return (pg or dist.group.WORLD)._get_backend(torch.device("cpu"))


# ----------------------------------------------------------------------------- local


def local_call(env: Env) -> Bad:
    c, b = env.call, Bad(env)
    kind, op, n, s = c.param("bad"), c.op, env.n, c.shape
    g = {"group": env.pg}
    if kind in ("reduce_op_for_dtype", "dtype_not_reducible"):
        rop = reduce_op(c.reduce_op, c.factor)
        if op == "all_reduce":
            x = b.t("tensor")
            b.fn = lambda: dist.all_reduce(x, op=rop, **g)
        elif op == "reduce":
            x = b.t("tensor")
            b.fn = lambda: dist.reduce(x, op=rop, group_dst=0, **g)
        elif op == "reduce_scatter":
            out, ins = b.t("output"), [b.t(f"input {j}") for j in range(n)]
            b.fn = lambda: dist.reduce_scatter(out, ins, op=rop, **g)
        else:
            out, x = b.t("output"), b.t("input", (n * s[0],))
            b.fn = lambda: dist.reduce_scatter_tensor(out, x, op=rop, **g)
    elif kind == "root_out_of_range":
        bad, x = c.root, b.t("tensor")
        b.fn = {"broadcast": lambda: dist.broadcast(x, group_src=bad, **g),
                "reduce": lambda: dist.reduce(x, group_dst=bad, **g),
                "scatter": lambda: dist.scatter(x, None, group_src=bad, **g),
                "gather": lambda: dist.gather(x, None, group_dst=bad, **g)}[op]
    elif kind == "peer_out_of_range":
        bad, x = c.root, b.t("tensor")
        b.fn = (lambda: dist.send(x, group_dst=bad, **g)) if op == "send" else (lambda: dist.recv(x, group_src=bad, **g))
    elif kind == "wrong_list_length":
        length = c.param("length")
        if op in ("scatter", "gather") and env.rank != c.root:
            return b  # only the root holds a list, and only it calls: nothing reaches the others
        x = b.t("tensor")
        lst = [b.t(f"list {j}") for j in range(length)]
        b.fn = {"all_gather": lambda: dist.all_gather(lst, x, **g),
                "reduce_scatter": lambda: dist.reduce_scatter(x, lst, **g),
                "all_to_all": lambda: dist.all_to_all(lst, [b.t(f"input {j}") for j in range(length)], **g),
                "scatter": lambda: dist.scatter(x, lst, group_src=env.me, **g),
                "gather": lambda: dist.gather(x, lst, group_dst=env.me, **g)}[op]
    elif kind == "sizes_do_not_fit":
        b.fn = _unfit(b, env, c.param("how"), g)
    elif kind == "dtypes_differ":
        other = OTHER_DTYPE[c.dtype]
        if op == "all_gather_into_tensor":
            out, x = b.t("output", (n * s[0],), other), b.t("input")
            b.fn = lambda: dist.all_gather_into_tensor(out, x, **g)
        else:
            out, x = b.t("output", None, other), b.t("input", (n * s[0],))
            b.fn = lambda: dist.reduce_scatter_tensor(out, x, **g)
    elif kind == "sparse_where_dense":
        b.fn = _sparse_where_dense(b, env, op, g)
    elif kind == "send_to_self":
        x, be = b.t("tensor"), backend_of(env.pg)
        b.fn = (lambda: be.send([x], env.me, 0).wait()) if op == "send" else (lambda: be.recv([x], env.me, 0).wait())
    else:
        raise ValueError(kind)
    return b


def _unfit(b: Bad, env: Env, how: str, g: dict):
    c, n, s0 = env.call, env.n, env.call.shape[0]
    op = c.op
    if op == "all_gather":  # this rank's own output cannot hold its input
        x = b.t("input")
        outs = [b.t(f"output {j}", (s0 + (how == "own_output_larger") - (how == "own_output_smaller"),)
                    if j == env.me else None) for j in range(n)]
        return lambda: dist.all_gather(outs, x, **g)
    if op == "all_gather_into_tensor":
        out, x = b.t("output", (n * s0 + (1 if how == "output_larger" else -1),)), b.t("input")
        return lambda: dist.all_gather_into_tensor(out, x, **g)
    if op == "reduce_scatter":
        out = b.t("output")
        ins = [b.t(f"input {j}", (s0 + 1,) if j == n - 1 else None) for j in range(n)]
        return lambda: dist.reduce_scatter(out, ins, **g)
    if op == "reduce_scatter_tensor":
        out, x = b.t("output"), b.t("input", (n * s0 + (1 if how == "input_larger" else -1),))
        return lambda: dist.reduce_scatter_tensor(out, x, **g)
    if op == "scatter":  # only the root calls: its list or its own output does not fit
        if env.rank != c.root:
            return None
        out = b.t("output", (s0 - 1,) if how == "output_smaller" else None)
        ins = [b.t(f"input {j}", (s0 + 1,) if how == "one_input_larger" and j == n - 1 else None) for j in range(n)]
        return lambda: dist.scatter(out, ins, group_src=env.me, **g)
    # all_to_all_single
    rows = n * s0
    if how == "rows_not_divisible" and n > 1:  # an even split (no split sizes) of rows W does not divide
        x, out = b.t("input", (rows + 1,)), b.t("output", (rows + 1,))
        return lambda: dist.all_to_all_single(out, x, **g)
    if how == "output_smaller":  # an even split of the input, into an output of fewer rows
        x, out = b.t("input", (rows,)), b.t("output", (rows - n,))
        return lambda: dist.all_to_all_single(out, x, **g)
    x, out = b.t("input", (rows,)), b.t("output", (rows,))
    splits = [s0] * n
    if how == "splits_too_few":
        return lambda: dist.all_to_all_single(out, x, splits + [0], splits + [0], **g)
    return lambda: dist.all_to_all_single(out, x, splits, [s0 + 1] + splits[1:], **g)  # sums to rows + 1


def _sparse_where_dense(b: Bad, env: Env, op: str, g: dict):
    s0, be = env.call.shape[0], backend_of(env.pg)
    sp = b.sparse("sparse tensor", s0)
    if op == "all_reduce_max":  # sparse all_reduce adds; nothing else
        rop = getattr(dist.ReduceOp, env.call.reduce_op)
        return lambda: dist.all_reduce(sp, op=rop, **g)
    peer = (env.me + 1) % env.n
    if op == "broadcast":
        opts = dist.BroadcastOptions()
        return lambda: be.broadcast([sp], opts).wait()
    if op == "reduce":
        opts = dist.ReduceOptions()
        return lambda: be.reduce([sp], opts).wait()
    if op == "all_gather":
        outs = [b.t(f"output {j}") for j in range(env.n)]
        return lambda: be.allgather([outs], [sp]).wait()
    if op == "send":
        return lambda: be.send([sp], peer, 0).wait()
    return lambda: be.recv([sp], peer, 0).wait()


def refused_locally(exc: BaseException | None) -> str | None:
    """What is wrong with how an illegal call failed (None: refused as it should be)."""
    if exc is None:
        return "it did not raise"
    if not isinstance(exc, (RuntimeError, ValueError)):
        return f"it raised {type(exc).__name__}, not a RuntimeError or ValueError: {exc}"
    if isinstance(exc, (dist.DistBackendError, dist.DistNetworkError)):
        return f"it left the rank (a group failure, not refused at issue): {type(exc).__name__}: {exc}"
    if BACKEND == "rustc10d" and "rustc10d" not in str(exc):
        return f"the error does not name rustc10d: {type(exc).__name__}: {exc}"
    return None


# ----------------------------------------------------------------------------- mismatch


def mismatch_call(env: Env) -> Bad:
    """This member's side of a mismatched call: the odd one out calls differently."""
    c, b = env.call, Bad(env)
    kind, n, s0 = c.param("bad"), env.n, c.shape[0]
    odd = env.rank == c.param("odd_one_out")
    g = {"group": env.pg}
    shape = (s0 + 1,) if kind == "size" and odd else c.shape
    dtype = OTHER_DTYPE[c.dtype] if kind == "dtype" and odd else c.dtype
    rop = dist.ReduceOp.MAX if kind == "reduce_op" and odd else dist.ReduceOp.SUM
    root = (1 % n) if kind == "root" and odd else 0  # group ranks
    op = c.op
    if "|" in op:
        op = op.split("|")[1 if odd else 0]

    def t(role, sh=None):
        return b.t(role, sh or shape, dtype)

    if op == "all_reduce":
        x = t("tensor")
        b.fn = lambda: dist.all_reduce(x, op=rop, **g)
    elif op == "barrier":
        b.fn = lambda: dist.barrier(**g)
    elif op == "broadcast":
        x = t("tensor")
        b.fn = lambda: dist.broadcast(x, group_src=root, **g)
    elif op == "reduce":
        x = t("tensor")
        b.fn = lambda: dist.reduce(x, group_dst=root, op=rop, **g)
    elif op == "all_gather_into_tensor":
        out, x = t("output", (n * shape[0],)), t("input")
        b.fn = lambda: dist.all_gather_into_tensor(out, x, **g)
    elif op == "reduce_scatter_tensor":
        out, x = t("output"), t("input", (n * shape[0],))
        b.fn = lambda: dist.reduce_scatter_tensor(out, x, op=rop, **g)
    elif op == "all_gather":
        outs, x = [t(f"output {j}") for j in range(n)], t("input")
        b.fn = lambda: dist.all_gather(outs, x, **g)
    elif op == "gather":
        x = t("input")
        outs = [t(f"output {j}") for j in range(n)] if env.me == root else None
        b.fn = lambda: dist.gather(x, outs, group_dst=root, **g)
    elif op == "scatter":
        out = t("output")
        ins = [t(f"input {j}") for j in range(n)] if env.me == root else None
        b.fn = lambda: dist.scatter(out, ins, group_src=root, **g)
    elif op == "all_to_all_single":  # the odd one out sends its next member one row more
        x_splits = [s0] * n
        if odd:
            x_splits[(env.me + 1) % n] += 1
        x, out = t("input", (sum(x_splits),)), t("output", (n * s0,))
        b.fn = lambda: dist.all_to_all_single(out, x, [s0] * n, x_splits, **g)
    elif op == "sparse_all_reduce":
        sp = b.sparse("sparse tensor", s0 + odd)
        b.fn = lambda: dist.all_reduce(sp, **g)
    else:
        raise ValueError(op)
    return b
