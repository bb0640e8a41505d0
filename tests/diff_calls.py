"""The differential suite's calls, as plain data: a generator of legal torch.distributed calls
and of illegal ones (diff_run.py issues them and checks the results, checks_differential.py
runs them as checks).

Call number i of a run is a pure function of (seed, world size, i): every rank generates the
same call without talking to the others, and one call can be replayed alone
(RUSTC10D_DIFF_ONLY=i) without generating the ones before it. Nothing here touches
torch.distributed.

Three kinds of call:
- "good": a legal call, checked against plain arithmetic;
- "local": an illegal call that every rank can see is illegal (an op the dtype does not
  support, a root out of range, a list of the wrong length, sizes that do not fit, a sparse
  tensor where a dense one is needed, a send to the own rank): it must raise at issue, before
  anything leaves the rank, and leave the group usable;
- "mismatch": legal on each rank, but the ranks disagree (sizes, dtypes, reduce ops, roots,
  ops): every rank must raise "does not match" and no output may change. Each runs on a group
  of its own, made for it, since a mismatch breaks its group by design.
"""

from __future__ import annotations

import dataclasses
import random

import torch

from checks import DTYPES, INT_DTYPES, WIDE_UNSIGNED, dtype_name, rejected_ops, supported_ops

COMPLEX_DTYPES = (torch.complex64, torch.complex128)
MOVE_DTYPES = DTYPES + COMPLEX_DTYPES + WIDE_UNSIGNED
# PREMUL_SUM factors: not powers of two, one negative, so a factor dropped, applied twice or
# applied to the wrong rank's data shows up
PREMUL_FACTORS = (0.3, -1.25, 2.5, 1 / 3)

# Ops whose input and output may be views of one tensor (param "memory": "shared"):
# all_to_all_single in place, where this rank's blocks fill as many rows as it sends; an
# all_gather_into_tensor's input the next member's block of its output; a
# reduce_scatter_tensor's output the next member's block of its input. Each must give what it
# gives on separate tensors (src/algorithms/apart.rs).
SHARING_OPS = ("all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor")

# Tensor layouts (diff_run.place() makes them). Each non-contiguous one is a view into storage
# with bytes around or between its elements, which must keep their values.
LAYOUTS = ("contiguous", "transposed", "strided", "offset", "misaligned", "channels_last")
# bytes at which the transports change algorithm: small all_reduce (16 KiB), single copy
# (64 KiB), arena slot and segment (1 MiB); "large" only now and then, for run time
SIZE_POINTS = (16 << 10, 64 << 10)
LARGE_ELEMENTS = 300_007  # odd: fits no even split; ~1.2 MB of float32, past slots and segments

# How often each kind of call comes up, and each legal op among the good ones.
LOCAL_RATE, MISMATCH_RATE = 0.08, 0.025
OP_WEIGHTS = {
    "all_reduce": 14, "reduce": 6, "broadcast": 8, "all_gather": 6, "all_gather_into_tensor": 6,
    "reduce_scatter": 5, "reduce_scatter_tensor": 6, "gather": 5, "scatter": 5,
    "all_to_all_single": 7, "all_to_all": 4, "send_recv": 4, "isend_irecv": 4, "batch_isend_irecv": 4,
    "barrier": 2, "sparse_all_reduce": 6, "all_reduce_coalesced": 2, "coalescing_manager": 2,
}
REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor")


def groups(world: int) -> dict[str, tuple[int, ...]]:
    """The groups calls run on (every rank creates them, in this order, once per job): the
    world; all ranks but rank 0 (a partial group: group rank = global rank - 1; a single rank
    at world size 2); the first and last rank, listed last-first (torch sorts a group's ranks:
    the listing must not matter)."""
    return {"world": tuple(range(world)), "tail": tuple(range(1, world)), "pair": (world - 1, 0)}


def members(world: int, group: str) -> tuple[int, ...]:
    return tuple(sorted(groups(world)[group]))


@dataclasses.dataclass(frozen=True)
class Call:
    seed: int
    world: int
    index: int
    kind: str  # "good", "local" or "mismatch"
    op: str
    group: str  # a groups() name; a mismatch's group is "fresh": made for it, of `ranks`
    ranks: tuple[int, ...]  # the group's members, global ranks, sorted
    dtype: torch.dtype = torch.float32
    shape: tuple[int, ...] = ()
    layout: str = "contiguous"
    reduce_op: str | None = None
    factor: float | None = None  # PREMUL_SUM's
    root: int | None = None  # a global rank
    by_group_rank: bool = False  # pass the root or peer as group_src / group_dst
    async_op: bool = False
    hold: bool = False  # left in flight, waited on with the next call that does not hold
    values: str = "plain"  # "special": NaN, ±inf and -0.0 among float inputs; "wrap": integers over their whole range
    params: tuple = ()  # op-specific (name, value) pairs

    def param(self, name, default=None):
        return dict(self.params).get(name, default)

    def describe(self) -> str:
        parts = [f"call #{self.index} (seed {self.seed}, world {self.world}): {self.kind} {self.op}",
                 f"dtype {dtype_name(self.dtype)}", f"shape {self.shape}", f"layout {self.layout}",
                 f"group {self.group}{list(self.ranks)}"]
        if self.reduce_op:
            parts.append(f"op {self.reduce_op}" + (f"({self.factor})" if self.factor is not None else ""))
        if self.root is not None:
            parts.append(f"root {self.root}" + (" (as group rank)" if self.by_group_rank else ""))
        if self.values != "plain":
            parts.append(f"values {self.values}")
        parts += [f"{k} {v}" for k, v in self.params]
        if self.async_op:
            parts.append("async, held in flight" if self.hold else "async")
        return ", ".join(parts)


def generate(seed: int, world: int, index: int) -> Call:
    """Call number `index` of the run (seed, world)."""
    rng = random.Random(f"rustc10d-differential|{seed}|{world}|{index}")
    base = {"seed": seed, "world": world, "index": index}
    r = rng.random()
    if r < MISMATCH_RATE:
        return _mismatch(rng, base)
    if r < MISMATCH_RATE + LOCAL_RATE:
        return _local(rng, base)
    return _good(rng, base)


# ----------------------------------------------------------------------------- shapes


def _shape(rng: random.Random, dtype, *, need_dim=False, ndim=None, large=True) -> tuple[int, ...]:
    """0-d, empty, 1, odd lengths, N-d, sizes just under and over the algorithm thresholds, and
    now and then LARGE_ELEMENTS. `need_dim`: at least one dimension (ops that split or stack
    along dim 0); `ndim`: exactly that many dimensions."""
    es = torch.empty((), dtype=dtype).element_size()
    r = rng.random()
    if large and r < 0.03:
        n = LARGE_ELEMENTS
    elif r < 0.15:
        n = rng.choice((0, 1))
        if n == 1 and not need_dim and ndim is None and rng.random() < 0.5:
            return ()
    elif r < 0.65:
        n = rng.randrange(2, 200) | 1
    elif r < 0.85:
        n = rng.randrange(200, 5000)
    else:
        point = rng.choice(SIZE_POINTS) // es
        n = point + rng.choice((-1, 0, 1, 17))
    if ndim is None:
        ndim = rng.choice((1, 1, 1, 2, 2, 3, 4))
    if ndim == 1 or n == 0 and rng.random() < 0.5:
        dims = [n] + [rng.randrange(1, 4) for _ in range(ndim - 1)]
        if n == 0 and ndim > 1:
            rng.shuffle(dims)  # the empty dimension anywhere
        return tuple(dims) if dims else (n,)
    lead = [rng.randrange(1, 6) for _ in range(ndim - 1)]
    prod = 1
    for d in lead:
        prod *= d
    return (*lead, max(1, n // prod))


def _layout(rng: random.Random, shape, dtype) -> str:
    layout = rng.choice(LAYOUTS + ("contiguous",))
    if layout == "transposed" and len(shape) < 2:
        return "contiguous"
    if layout == "channels_last" and len(shape) != 4:
        return "contiguous"
    if layout == "misaligned" and (torch.empty((), dtype=dtype).element_size() == 1 or dtype.is_complex):
        return "offset"  # torch's own copy into a misaligned complex tensor crashes (SIGSEGV)
    return layout


def _shape_and_layout(rng, dtype, **kw):
    """A shape (now and then 4-D, which channels_last needs), then a layout it allows."""
    if rng.random() < 0.1:
        kw["ndim"] = 4
    shape = _shape(rng, dtype, **kw)
    return shape, _layout(rng, shape, dtype)


def _values(rng, dtype, reduce_op) -> str:
    if dtype.is_floating_point and rng.random() < 0.1:
        return "special"
    if dtype in INT_DTYPES and reduce_op in ("SUM", "PRODUCT") and rng.random() < 0.25:
        return "wrap"
    return "plain"


def _reduce_op(rng, dtype) -> tuple[str, float | None]:
    op = rng.choice(supported_ops(dtype))
    return op, (rng.choice(PREMUL_FACTORS) if op == "PREMUL_SUM" else None)


def _group(rng, world, min_size=1) -> tuple[str, tuple[int, ...]]:
    name = rng.choices(("world", "tail", "pair"), (6, 2, 2))[0]
    if len(members(world, name)) < min_size:
        name = "world"
    return name, members(world, name)


# ----------------------------------------------------------------------------- good calls


def _good(rng: random.Random, base: dict) -> Call:
    world = base["world"]
    op = rng.choices(list(OP_WEIGHTS), list(OP_WEIGHTS.values()))[0]
    p2p = op in ("send_recv", "isend_irecv", "batch_isend_irecv")
    group, ranks = _group(rng, world, 2 if p2p else 1)
    call = {**base, "kind": "good", "op": op, "group": group, "ranks": ranks}
    params = []
    if op in REDUCING or op in ("all_reduce_coalesced", "coalescing_manager"):
        dtype = rng.choice(WIDE_UNSIGNED) if op in REDUCING and rng.random() < 0.1 else rng.choice(DTYPES)
        # complex: torch's all_reduce hands it on as (re, im) pairs; reduce and reduce_scatter
        # pass it as complex, which rustc10d reduces as such pairs (by these ops), as NCCL does
        if op in REDUCING and rng.random() < 0.08:
            dtype = rng.choice(COMPLEX_DTYPES)
            reduce_op = rng.choice(("SUM", "AVG", "PREMUL_SUM"))
            factor = rng.choice(PREMUL_FACTORS) if reduce_op == "PREMUL_SUM" else None
        else:
            reduce_op, factor = _reduce_op(rng, dtype)
        call.update(dtype=dtype, reduce_op=reduce_op, factor=factor, values=_values(rng, dtype, reduce_op))
        if reduce_op == "PREMUL_SUM" and rng.random() < 0.3:
            params.append(("factor_as", "tensor"))  # dist._make_nccl_premul_sum(a one-element tensor)
    elif op == "sparse_all_reduce":
        call.update(dtype=rng.choice((torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                      torch.int64, torch.int32, torch.uint8, torch.bool)), reduce_op="SUM")
    elif op != "barrier":
        call["dtype"] = rng.choice(MOVE_DTYPES) if rng.random() < 0.4 else rng.choice(DTYPES)

    dtype = call.get("dtype", torch.float32)
    split = op in ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "reduce_scatter_tensor")
    if op == "barrier":
        pass
    elif op == "sparse_all_reduce":
        form = rng.choice(("coalesced", "uncoalesced", "overlapping", "empty", "hybrid"))
        nrows = rng.choice((1, 5, 17, 1000))
        params += [("form", form), ("rows", nrows)]
        call["shape"] = (nrows, rng.choice((2, 3))) if form == "hybrid" else \
            rng.choice(((nrows,), (nrows, 4), (nrows, 3, 2)))
    elif op in ("all_reduce_coalesced", "coalescing_manager"):
        count = rng.randrange(1, 5)
        shapes = tuple(_shape(rng, dtype, large=False, need_dim=op == "coalescing_manager") for _ in range(count))
        params.append(("shapes", shapes))
        if op == "coalescing_manager":
            params.append(("inner", rng.choice(("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"))))
            call["async_op"] = rng.random() < 0.5
    else:
        shape, layout = _shape_and_layout(rng, dtype, need_dim=split, large=op not in ("all_to_all",))
        call.update(shape=shape, layout=layout)

    if op in ("reduce", "broadcast", "gather", "scatter"):
        call["root"] = rng.choice(ranks)
        call["by_group_rank"] = rng.random() < 0.3
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        params.append(("form", rng.choice(("cat", "stack"))))  # (W*n, ...) or (W, n, ...)
    if op in ("all_to_all_single", "all_to_all"):
        params += _all_to_all_rows(rng, op, len(ranks), call["shape"][0])
    if op in ("send_recv", "isend_irecv", "batch_isend_irecv"):
        params += _p2p_params(rng, op, ranks)
        call["by_group_rank"] = rng.random() < 0.3
    if op not in ("send_recv", "isend_irecv", "batch_isend_irecv", "coalescing_manager"):
        call["async_op"] = rng.random() < 0.35
        call["hold"] = call["async_op"] and rng.random() < 0.5
    if op in SHARING_OPS:  # drawn last, so that the calls before it stay as they were
        params.append(("memory", rng.choice(("apart", "apart", "apart", "shared"))))
    return Call(**call, params=tuple(params))


def _all_to_all_rows(rng, op, n, rows) -> list:
    """Rows each member sends each member: a table [src][dst] (member indices). "even": every
    block `rows`; "uneven": 0 to 3x; "zero": like uneven with whole rows and columns of 0."""
    mode = rng.choice(("even", "even", "uneven", "zero"))
    if mode == "even":
        table = tuple((rows,) * n for _ in range(n))
    else:
        table = [[rng.randrange(0, 3 * rows + 2) for _ in range(n)] for _ in range(n)]
        if mode == "zero":
            quiet = rng.randrange(n)
            for k in range(n):
                table[quiet][k] = 0
                table[k][rng.randrange(n)] = 0
        table = tuple(tuple(row) for row in table)
    params = [("split", mode), ("rows", table)]
    if op == "all_to_all_single" and mode == "even":
        params.append(("split_sizes", rng.choice(("none", "given"))))  # even split by torch or listed
    return params


def _p2p_params(rng, op, ranks) -> list:
    if op == "send_recv":
        src, dst = rng.sample(ranks, 2)
        how = rng.choice(("blocking", "async", "recv_any"))
        return [("src", src), ("dst", dst), ("how", how), ("tag", rng.randrange(0, 8))]
    if op == "isend_irecv":  # a ring over the members
        return [("order", rng.choice(("sends_first", "recvs_first"))), ("tag", rng.randrange(0, 8))]
    return [("pattern", rng.choice(("all_pairs", "ring")))]  # batch_isend_irecv


# ----------------------------------------------------------------------------- illegal calls

# kind -> ops it applies to; every one is refused by rustc10d itself (torch's own Python
# checks would name torch, not the backend, so calls torch refuses first are not generated).
LOCAL_KINDS = {
    "reduce_op_for_dtype": REDUCING,  # AVG/PREMUL_SUM on integers and bool, BAND/BOR/BXOR on floats
    # complex by PRODUCT, MIN or MAX, where torch passes it on (its all_reduce refuses them itself)
    "dtype_not_reducible": ("reduce", "reduce_scatter", "reduce_scatter_tensor"),
    "root_out_of_range": ("broadcast", "reduce", "scatter", "gather"),
    "peer_out_of_range": ("send", "recv"),
    "wrong_list_length": ("all_gather", "reduce_scatter", "all_to_all", "scatter", "gather"),
    "sizes_do_not_fit": ("all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                         "scatter", "all_to_all_single"),
    "dtypes_differ": ("all_gather_into_tensor", "reduce_scatter_tensor"),  # torch checks the list ops
    "sparse_where_dense": ("broadcast", "reduce", "all_gather", "send", "recv", "all_reduce_max"),
    "send_to_self": ("send", "recv"),
}


def _local(rng: random.Random, base: dict) -> Call:
    world = base["world"]
    kind = rng.choice(list(LOCAL_KINDS))
    op = rng.choice(LOCAL_KINDS[kind])
    group, ranks = _group(rng, world)
    call = {**base, "kind": "local", "op": op, "group": group, "ranks": ranks,
            "shape": (rng.randrange(1, 40),), "dtype": rng.choice(DTYPES)}
    params = [("bad", kind)]
    if kind == "reduce_op_for_dtype":
        call["dtype"] = rng.choice([d for d in DTYPES + WIDE_UNSIGNED if rejected_ops(d)])
        call["reduce_op"] = rng.choice(rejected_ops(call["dtype"]) + (("PREMUL_SUM",) if not call["dtype"].is_floating_point else ()))
        call["factor"] = 0.3 if call["reduce_op"] == "PREMUL_SUM" else None
    elif kind == "dtype_not_reducible":
        call["dtype"], call["reduce_op"] = rng.choice(COMPLEX_DTYPES), rng.choice(("PRODUCT", "MIN", "MAX"))
    elif kind in ("root_out_of_range", "peer_out_of_range"):
        call["root"] = len(ranks) + rng.randrange(0, 3)  # a group rank past the end
        call["by_group_rank"] = True
    elif kind == "wrong_list_length":
        # (torch itself refuses an empty list at the root of a scatter or gather, and empty
        # all_to_all lists: no tensor to dispatch on)
        lengths = [k for k in (len(ranks) - 1, len(ranks) + 1, 0) if k or op not in ("scatter", "gather", "all_to_all")]
        params.append(("length", rng.choice(lengths)))
        if op in ("scatter", "gather"):
            call["root"] = rng.choice(ranks)  # only the root calls: the list is the root's
    elif kind == "sizes_do_not_fit":
        params.append(("how", _unfit(rng, op)))
        if op == "scatter":
            call["root"] = rng.choice(ranks)
    elif kind == "dtypes_differ":
        call["dtype"] = rng.choice((torch.float32, torch.int32))  # the output gets the other, same size
    elif kind == "sparse_where_dense":
        call["dtype"] = rng.choice((torch.float32, torch.float64))
        if op == "all_reduce_max":
            call["reduce_op"] = rng.choice(("MAX", "MIN", "PRODUCT", "AVG"))
    elif kind == "send_to_self":
        group, ranks = _group(rng, world, 2)
        call.update(group=group, ranks=ranks)
    return Call(**call, params=tuple(params))


def _unfit(rng, op) -> str:
    return rng.choice({
        "all_gather": ("own_output_larger", "own_output_smaller"),
        "all_gather_into_tensor": ("output_larger", "output_smaller"),
        "reduce_scatter": ("one_input_larger",),
        "reduce_scatter_tensor": ("input_larger", "input_smaller"),
        "scatter": ("one_input_larger", "output_smaller"),
        "all_to_all_single": ("splits_sum_wrong", "splits_too_few", "rows_not_divisible", "output_smaller"),
    }[op])


MISMATCH_KINDS = ("size", "dtype", "reduce_op", "root", "op", "all_to_all_rows", "sparse_size")


def _mismatch(rng: random.Random, base: dict) -> Call:
    """A call the ranks of a fresh group make differently: one member (the odd one out)
    deviates from the others."""
    world = base["world"]
    ranks = tuple(range(world)) if rng.random() < 0.6 else tuple(sorted(rng.sample(range(world), 2)))
    kind = rng.choice(MISMATCH_KINDS)
    odd = rng.choice(ranks)
    dtype = rng.choice((torch.float32, torch.int32, torch.float64, torch.int64, torch.bfloat16, torch.float16))
    op = {
        "size": rng.choice(("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                            "all_gather", "gather", "scatter")),
        "dtype": rng.choice(("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor")),
        "reduce_op": rng.choice(("all_reduce", "reduce", "reduce_scatter_tensor")),
        "root": rng.choice(("broadcast", "reduce")),
        "op": rng.choice(("all_reduce|broadcast", "all_gather_into_tensor|reduce_scatter_tensor",
                          "all_reduce|barrier", "broadcast|reduce")),
        "all_to_all_rows": "all_to_all_single",
        "sparse_size": "sparse_all_reduce",
    }[kind]
    if kind == "reduce_op":
        dtype = rng.choice((torch.float32, torch.int32))
    shape = (rng.choice((1, 7, 300, 5000, 70_001)),)
    params = [("bad", kind), ("odd_one_out", odd)]
    if rng.random() < 0.3:  # the group's first op: its slower members may still be joining
        params.append(("first_op", True))
    return Call(**base, kind="mismatch", op=op, group="fresh", ranks=ranks, dtype=dtype, shape=shape,
                reduce_op="SUM" if op in REDUCING or "all_reduce" in op else None,
                root=ranks[0] if kind != "root" else None, params=tuple(params))
