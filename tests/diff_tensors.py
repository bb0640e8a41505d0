"""Tensors for the differential suite: deterministic inputs, the layouts they are placed in,
the arithmetic results are checked against, and the comparisons.

Every value is a function of (seed, world, call index, role, rank), so each rank builds every
other rank's inputs and computes every expected result locally.
"""

from __future__ import annotations

import functools
import zlib

import torch

from checks import SIGNED_OF, WIDE_UNSIGNED, differences, make_input, reduce_unsigned, tolerance
from diff_calls import Call


def _seed(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(key.encode()))


def element_size(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def make(key: str, shape, dtype, op: str = "", values: str = "plain") -> torch.Tensor:
    """checks.make_input, plus the dtypes it lacks and the value flavours of diff_calls."""
    if dtype in WIDE_UNSIGNED:
        return make(key, shape, SIGNED_OF[dtype], "", values).view(dtype)
    if values == "wrap" and not dtype.is_floating_point:
        op = "MAX"  # make_input's full integer range: SUM and PRODUCT wrap around
    t = make_input(key, tuple(shape), dtype, op)
    if values == "special" and dtype.is_floating_point and t.numel():
        g = _seed(f"{key}|special")
        where = torch.rand(t.shape, generator=g) < 0.15
        pick = torch.randint(0, 4, t.shape, generator=g)
        specials = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0], dtype=torch.float64)
        t = torch.where(where, specials[pick].to(dtype), t)
    return t


class Inputs:
    """The deterministic tensors of one call."""

    def __init__(self, call: Call):
        self.call = call
        self.key = f"diff|{call.seed}|{call.world}|{call.index}"

    def of(self, rank: int, role: str = "in", shape=None, dtype=None, values=None) -> torch.Tensor:
        """`rank`'s tensor in `role`: what it sends or reduces (any rank can build any rank's)."""
        c = self.call
        return make(f"{self.key}|{role}|{rank}", c.shape if shape is None else shape, dtype or c.dtype,
                    c.reduce_op or "", c.values if values is None else values)

    def garbage(self, rank: int, shape, dtype=None, role="garbage") -> torch.Tensor:
        """An output's contents before the op: random, so an element left unwritten shows."""
        return make(f"{self.key}|{role}|{rank}", shape, dtype or self.call.dtype)


# ----------------------------------------------------------------------------- layouts


class Placed:
    """A tensor in a layout: `view` holds the values; `around` pairs each piece of storage
    outside the view (between or around its elements) with a copy of it, which must not
    change."""

    def __init__(self, view: torch.Tensor, around=(), keep=None):
        self.view = view
        self.around = [(live, live.clone()) for live in around]
        self.keep = keep  # a Python buffer the view lives in

    def outside_changed(self, where: str) -> str | None:
        for i, (live, before) in enumerate(self.around):
            if not torch.equal(_bytes(live), _bytes(before)):
                return f"{where}: storage outside the tensor changed (piece {i} of {len(self.around)})"
        return None


def place(values: torch.Tensor, layout: str, key: str) -> Placed:
    """A copy of `values` in `layout` (diff_calls.LAYOUTS), its surroundings filled with data
    that must stay put."""
    shape, dtype, n = tuple(values.shape), values.dtype, values.numel()
    if layout == "transposed" and len(shape) >= 2:
        # a copy, also where the permuted view is contiguous already (dimensions of size 1)
        storage = values.permute(*reversed(range(len(shape)))).clone(memory_format=torch.contiguous_format)
        return Placed(storage.permute(*reversed(range(len(shape)))))
    if layout == "strided" and len(shape) >= 1:
        base = make(f"{key}|gaps", (*shape[:-1], 2 * shape[-1]), dtype)
        view = base[..., ::2]
        view.copy_(values)
        return Placed(view, [base[..., 1::2]])
    if layout == "channels_last" and len(shape) == 4:
        view = torch.empty(shape, dtype=dtype, memory_format=torch.channels_last)
        view.copy_(values)
        return Placed(view)
    if layout == "offset" or (layout == "misaligned" and (element_size(dtype) == 1 or n == 0)):
        k = 1 + zlib.crc32(key.encode()) % 7
        base = make(f"{key}|around", (k + n + 3,), dtype)
        view = base[k:k + n].view(shape)
        view.copy_(values)
        return Placed(view, [base[:k], base[k + n:]])
    if layout == "misaligned":
        es = element_size(dtype)
        off = 1 + zlib.crc32(key.encode()) % (es - 1)  # never a multiple of the element size
        buf = bytearray(off + n * es + 5)
        raw = torch.frombuffer(buf, dtype=torch.uint8)
        raw.copy_(make(f"{key}|around", (len(buf),), torch.uint8))
        view = torch.frombuffer(buf, dtype=dtype, offset=off, count=n).view(shape)
        view.copy_(values)
        return Placed(view, [raw[:off], raw[off + n * es:]], keep=buf)
    return Placed(values.clone())


# ----------------------------------------------------------------------------- arithmetic

_BITWISE = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}
INEXACT_OPS = ("SUM", "PRODUCT", "AVG", "PREMUL_SUM")


def reduction(inputs: list[torch.Tensor], op: str, factor: float | None = None) -> torch.Tensor:
    """The exact reduction of the ranks' inputs: float64 for floating dtypes (compared with a
    tolerance where rounding may differ), the input dtype otherwise (integers wrap like
    torch's). Complex inputs are reduced as (re, im) pairs, as torch hands them to backends."""
    dtype = inputs[0].dtype
    if dtype.is_complex:
        return torch.view_as_complex(reduction([torch.view_as_real(t) for t in inputs], op, factor))
    if dtype in WIDE_UNSIGNED:
        return reduce_unsigned(inputs, op, lambda ts, o: reduction(ts, o, factor))
    if op in _BITWISE:
        return functools.reduce(_BITWISE[op], inputs)
    stacked = torch.stack(inputs)
    if dtype == torch.bool:  # SUM and MAX are OR, PRODUCT and MIN are AND (NCCL's, rustc10d's)
        return stacked.any(0) if op in ("SUM", "MAX") else stacked.all(0)
    wide = stacked.to(torch.float64 if dtype.is_floating_point else torch.int64)
    if op == "SUM":
        out = wide.sum(0)
    elif op == "PRODUCT":
        out = wide.prod(0)
    elif op == "MIN":
        out = wide.amin(0)
    elif op == "MAX":
        out = wide.amax(0)
    elif op == "AVG":
        out = wide.mean(0)
    elif op == "PREMUL_SUM":
        out = wide.sum(0) * factor
    else:
        raise ValueError(op)
    return out if dtype.is_floating_point else out.to(dtype)


def expect_reduced(got: torch.Tensor, inputs: list[torch.Tensor], op: str, factor, where: str) -> str | None:
    expected = reduction(inputs, op, factor)
    dtype = inputs[0].dtype
    base = dtype.to_real() if dtype.is_complex else dtype
    if base.is_floating_point and op in INEXACT_OPS:
        return expect_close(got, expected, dtype, len(inputs), where)
    return expect_same(got, expected.to(dtype), where)


def expect_close(got, expected_wide, dtype, n_ranks, where) -> str | None:
    if bad := _meta(got, dtype, tuple(expected_wide.shape), where):
        return bad
    if got.is_complex():
        got, expected_wide = torch.view_as_real(got), torch.view_as_real(expected_wide)
        dtype = dtype.to_real()
    tol = tolerance(dtype, n_ranks)
    ok = torch.isclose(got.double(), expected_wide.double(), equal_nan=True, **tol)
    return None if bool(ok.all()) else f"{where}: {differences(got, expected_wide, ~ok)} (tolerance {tol})"


def expect_same(got: torch.Tensor, expected: torch.Tensor, where: str) -> str | None:
    """Equal element for element (NaN equal to NaN); a bool must be stored as 0 or 1."""
    if bad := _meta(got, expected.dtype, tuple(expected.shape), where):
        return bad
    if got.dtype == torch.bool and got.numel():
        top = int(got.contiguous().view(torch.uint8).max())
        if top > 1:
            return f"{where}: a bool is stored as byte {top}"
    g, e = _comparable(got), _comparable(expected)
    same = g == e
    if g.is_floating_point():
        same |= g.isnan() & e.isnan()
    return None if bool(same.all()) else f"{where}: {differences(g, e, ~same)}"


def _comparable(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in SIGNED_OF:
        return t.contiguous().view(SIGNED_OF[t.dtype])
    if t.is_complex():
        return torch.view_as_real(t.contiguous())
    return t


def _meta(got, dtype, shape, where) -> str | None:
    if got.dtype != dtype:
        return f"{where}: dtype {got.dtype}, expected {dtype}"
    if tuple(got.shape) != shape:
        return f"{where}: shape {tuple(got.shape)}, expected {shape}"
    return None




def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (so a NaN compares equal to itself)."""
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8)
    # a copy with plain strides: .contiguous() keeps the strides of dimensions of size 1
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).reshape(-1).view(torch.uint8)


def unchanged(live: torch.Tensor, before: torch.Tensor, where: str) -> str | None:
    """`live` holds the same bytes as `before` (its copy from before the op)."""
    if live.layout != torch.strided:  # sparse: the same tensor it was
        same = torch.equal(live.to_dense(), before.to_dense())
    else:
        same = torch.equal(_bytes(live), _bytes(before))
    return None if same else f"{where}: changed"
