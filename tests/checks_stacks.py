"""End-to-end checks of the PyTorch stacks built on torch.distributed, with 2 and 4 ranks on CPU:
DDP, FSDP2, pipelining, distributed checkpoint (DCP) and a 2-D DeviceMesh. Each stack is a job
of its own (checks.Check.job), so one stack that hangs or breaks its group costs only its own
checks.

The training stacks train the same model on the same data twice in the same processes: over the
backend under test (the job's default group) and over a Gloo group, and must end with the same
losses and parameters (allclose: backends may add in different orders). DCP and DeviceMesh are
checked against the data itself. Each stack's modules are imported inside its checks, so the
main job never pays for them.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from checks import Ctx, check, make_input, new_group, register
from checks_ops import expect_group_works

STACK_WORLDS = (2, 4)
# float32 training, a few steps: only the order of additions may differ between backends
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
# fp16_compress_hook sums fp16 gradients: one fp16 rounding more or less per addition
FP16_TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}
IN, HIDDEN, OUT = 6, 15, 4  # 15: no even split into shards, so FSDP2 pads


def _stack(job: str, worlds=STACK_WORLDS):
    """Decorator: a check of the "stacks" suite, run by the job `job`."""
    return check("stacks", worlds=worlds, job=job)


def _register_stack(job: str, name: str, fn):
    register("stacks", name, fn, STACK_WORLDS, job=job)


@functools.cache
def gloo_group():
    """The reference: Gloo over every rank. Created on first use, which is at the same point on
    every rank (first thing in expect_same_as_gloo)."""
    return new_group(backend="gloo")


def expect_same_as_gloo(ctx: Ctx, run, tolerance=TOLERANCE):
    """run(group) -> {name: tensor}: over the backend under test it must give what it gives over
    Gloo, on every rank."""
    reference = run(gloo_group())
    got = run(dist.group.WORLD)
    assert got.keys() == reference.keys(), f"{sorted(got)} vs. {sorted(reference)}"
    for name, expected in reference.items():
        ctx.expect_close(got[name], expected, f"{name} vs. Gloo", **tolerance)


def _batch(key, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of one step; `key` says whose batch (a rank's, or the whole pipeline's)."""
    key = f"batch|{key}|{step}|{micro}"
    return make_input(key, (8, IN), torch.float32), make_input(key, (8, OUT), torch.float32, op="target")


def _trained(module: nn.Module, losses: list) -> dict[str, torch.Tensor]:
    """What a training run is judged by: its losses (if this rank has any) and final
    parameters (whole, if sharded)."""
    result = {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for name, p in module.named_parameters()}
    if losses:
        result["losses"] = torch.stack(losses)
    return result


class Mlp(nn.Module):
    """IN -> HIDDEN -> OUT, plus a side branch IN -> OUT that the caller may leave unused."""

    def __init__(self, first_dtype=torch.float32):
        super().__init__()
        self.first = nn.Linear(IN, HIDDEN, dtype=first_dtype)
        self.second = nn.Linear(HIDDEN, OUT)
        self.side = nn.Linear(IN, OUT)

    def forward(self, x, use_side=True):
        out = self.second(torch.tanh(self.first(x.to(self.first.weight.dtype))).float())
        return out + self.side(x) if use_side else out


# ============================================================================= DDP


def _mean_by_future_hook(group, bucket):
    """A user comm hook: average the flat bucket with an async all_reduce and a Future chain."""
    flat = bucket.buffer().div_(group.size())
    return dist.all_reduce(flat, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _comm_hook(name: str):
    if name == "fp16_compress":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        return fp16_compress_hook
    return {"future": _mean_by_future_hook}[name]


def _ddp_training(ctx: Ctx, group, *, steps=3, micro_batches=1, uses_side=None, hook=None, first_dtype=torch.float32,
                  **ddp_options) -> dict[str, torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = Mlp(first_dtype)
    ddp = DDP(model, process_group=group, **ddp_options)
    if hook:
        ddp.register_comm_hook(group, _comm_hook(hook))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        for micro in range(micro_batches):
            # gradients add up locally (no_sync) until the last micro-batch, whose backward syncs them
            with ddp.no_sync() if micro < micro_batches - 1 else contextlib.nullcontext():
                x, y = _batch(ctx.rank, step, micro)
                loss = F.mse_loss(ddp(x, uses_side(ctx.rank, step) if uses_side else True), y)
                loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return _trained(model, losses)


# name -> (_ddp_training options, tolerance)
_DDP_VARIANTS = {
    "ddp": ({}, TOLERANCE),
    # the side branch is unused on half the ranks in each step
    "ddp_find_unused_parameters": ({"find_unused_parameters": True,
                                    "uses_side": lambda rank, step: (rank + step) % 2 == 0}, TOLERANCE),
    # a float64 layer: its gradients go in buckets of their own; tiny buckets, so several
    "ddp_mixed_dtype_buckets": ({"first_dtype": torch.float64, "bucket_cap_mb": 0.0005}, TOLERANCE),
    "ddp_no_sync": ({"micro_batches": 2}, TOLERANCE),
    "ddp_fp16_compress_hook": ({"hook": "fp16_compress"}, FP16_TOLERANCE),
    "ddp_future_hook": ({"hook": "future"}, TOLERANCE),
}


def _ddp_check(ctx: Ctx, options: dict, tolerance: dict):
    expect_same_as_gloo(ctx, functools.partial(_ddp_training, ctx, **options), tolerance)


for _name, (_options, _tolerance) in _DDP_VARIANTS.items():
    _register_stack("ddp", _name, functools.partial(_ddp_check, options=_options, tolerance=_tolerance))


def _ddp_sparse_embedding_training(ctx: Ctx, group, steps=3) -> dict[str, torch.Tensor]:
    """A recommendation model's core: nn.Embedding(sparse=True), whose gradients DDP all_reduces
    as uncoalesced sparse tensors (the same rows looked up on several ranks, and twice on one)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 5, sparse=True), nn.Flatten(), nn.Linear(15, OUT))
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        ids = torch.tensor([[ctx.rank % 3, 7, 7], [step, 19 - ctx.rank, 0]])
        loss = F.mse_loss(ddp(ids), _batch(ctx.rank, step)[1][:2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return _trained(model, losses)


_register_stack("ddp", "ddp_sparse_embedding",
                lambda ctx: expect_same_as_gloo(ctx, functools.partial(_ddp_sparse_embedding_training, ctx)))


# ============================================================================= FSDP2


@_stack("fsdp2")
def fsdp2(ctx: Ctx):
    """fully_shard per layer and at the root; parameters compared whole (full_tensor())."""

    def train(group, steps=3):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        torch.manual_seed(0)
        model = Mlp()
        for layer in (model.first, model.second, model.side):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(steps):
            x, y = _batch(ctx.rank, step)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return _trained(model, losses)

    expect_same_as_gloo(ctx, train)


# ============================================================================= pipelining


def _pipeline_training(ctx: Ctx, group, schedule: str, steps=2) -> dict[str, torch.Tensor]:
    """One stage per rank; rank 0 feeds 4 micro-batches, the last rank computes the loss."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(IN, IN), nn.Tanh()) for _ in range(ctx.world)]  # alike on all ranks
    module = stages[ctx.rank]
    stage = PipelineStage(module, ctx.rank, ctx.world, torch.device("cpu"), group=group)
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
    pipeline = schedule_cls(stage, n_microbatches=4, loss_fn=F.mse_loss)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for step in range(steps):
        x, y = _batch("pipeline", step)
        y = y.repeat(1, 2)[:, :IN]  # the last stage outputs IN features
        if ctx.rank == 0:
            pipeline.step(x)
        elif ctx.rank == ctx.world - 1:
            pipeline.step(target=y, losses=losses)
        else:
            pipeline.step()
        opt.step()
        opt.zero_grad()
    return _trained(module, [loss.detach() for loss in losses])  # only the last rank has losses


def _pipeline_check(ctx: Ctx, schedule: str):
    expect_same_as_gloo(ctx, functools.partial(_pipeline_training, ctx, schedule=schedule))


for _schedule in ("gpipe", "1f1b"):
    _register_stack("pipelining", f"pipelining_{_schedule}", functools.partial(_pipeline_check, schedule=_schedule))


# ============================================================================= DCP


@_stack("dcp")
def dcp_sharded_state_dict(ctx: Ctx):
    """dcp.save of a state dict of DTensors sharded across all ranks (unevenly), replicated, and a
    plain value; dcp.load into zeroed DTensors of the same sharding, then of another (resharded
    on load): every rank gets back exactly its part of what was saved."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    full = {"weight": make_input("dcp|weight", (5 * ctx.world + 3, 7), torch.float32),
            "bias": make_input("dcp|bias", (6, 2 * ctx.world + 1), torch.bfloat16),
            "table": make_input("dcp|table", (ctx.world, 3), torch.int64)}
    saved_layout = {"weight": Shard(0), "bias": Shard(1), "table": Replicate()}
    other_layout = {"weight": Shard(1), "bias": Replicate(), "table": Shard(0)}

    def sharded(tensors, layout):  # every rank has the whole tensor: no communication
        return {k: distribute_tensor(t, mesh, [layout[k]], src_data_rank=None) for k, t in tensors.items()}

    path = os.path.join(ctx.scratch, "dcp-checkpoint")  # shared by the ranks of this job
    dcp.save({**sharded(full, saved_layout), "step": 7}, checkpoint_id=path)
    for name, layout in (("the saved sharding", saved_layout), ("another sharding", other_layout)):
        target = {**sharded({k: torch.zeros_like(t) for k, t in full.items()}, layout), "step": 0}
        dcp.load(target, checkpoint_id=path)
        for k, t in full.items():
            expected = distribute_tensor(t, mesh, [layout[k]], src_data_rank=None).to_local()
            ctx.expect_equal(target[k].to_local(), expected, f"{k} loaded into {name}")
        assert target["step"] == 7, f"plain value loaded as {target['step']!r}"


# ============================================================================= DeviceMesh


@_stack("device_mesh", worlds=(4,))
def device_mesh_2d(ctx: Ctx):
    """init_device_mesh("cpu", (2, W/2)): each dimension's group holds exactly that column or row
    of ranks; collectives run on both dimensions' groups at once, and a DTensor sharded over both
    dimensions gathers back whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rows, cols = 2, ctx.world // 2
    mesh = init_device_mesh("cpu", (rows, cols), mesh_dim_names=("dp", "tp"))
    layout = torch.arange(ctx.world).reshape(rows, cols)
    row, col = divmod(ctx.rank, cols)
    groups = {"dp": mesh.get_group("dp"), "tp": mesh.get_group("tp")}
    for dim, expected in (("dp", layout[:, col].tolist()), ("tp", layout[row].tolist())):
        got = dist.get_process_group_ranks(groups[dim])
        assert got == expected, f"mesh dimension {dim}: group of ranks {got}, expected {expected}"
    expect_group_works(ctx, groups["dp"], groups["tp"])

    full = make_input("mesh|full", (2 * rows + 1, 3 * cols), torch.float32)
    dt = distribute_tensor(full, mesh, [Shard(0), Shard(1)], src_data_rank=None)
    ctx.expect_equal(dt.full_tensor(), full, "DTensor sharded over both dimensions, gathered")
