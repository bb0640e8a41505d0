"""One rank of the CUDA checks (scripts/gpu_check.sh launches it with torchrun on a GPU machine).

Every rank drives rustc10d and Gloo groups over CUDA tensors (NCCL too where each rank has a GPU
of its own) and compares results with plain arithmetic; then stream-ordering tests (wait() timed
while its inputs are still being produced: `WAIT` lines), an injected failure that must leave the
tensor as it was, coalesced batches, DDP and FSDP2 steps against Gloo or one process (`STEP`),
and a quick timing against Gloo (`BUSBW`). RUSTC10D_CUDA_WAIT=stream (gpu_check.sh runs both
modes) also requires wait() to return within 1 ms. Prints `CHECK <name> ok|FAIL <why>` lines and
exits 1 on any failure. Not part of pytest: CI has no GPU.
"""

import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

import rustc10d  # registers the backend

FAILURES = []


def check(name):
    def deco(fn):
        try:
            fn()
            print(f"CHECK rank {RANK} {name} ok", flush=True)
        except Exception as e:  # noqa: BLE001 - every failure is reported, then the next check runs
            FAILURES.append(name)
            print(f"CHECK rank {RANK} {name} FAIL {type(e).__name__}: {e}", flush=True)
            traceback.print_exc()
        dist.barrier(group=CPU)
        return fn
    return deco


def same(got, want, what):
    if not torch.equal(got.cpu(), want.cpu()):
        raise AssertionError(f"{what}: got {got.flatten()[:8].tolist()}..., want {want.flatten()[:8].tolist()}...")


dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # the CPU group: barriers only
RANK, WORLD = dist.get_rank(), dist.get_world_size()
CPU = dist.group.WORLD
ngpu = torch.cuda.device_count()
DEV = torch.device("cuda", RANK % ngpu)
torch.cuda.set_device(DEV)
RUST = dist.new_group(backend="rustc10d", timeout=timedelta(seconds=60))
GLOO = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
# NCCL refuses two ranks on one GPU.
NCCL = dist.new_group(backend="nccl") if ngpu >= WORLD and dist.is_nccl_available() else None
print(f"rank {RANK}/{WORLD} on {DEV} ({torch.cuda.get_device_name(DEV)}), NCCL {'on' if NCCL else 'off'}", flush=True)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32,
          torch.int64, torch.bool]


def ramp(n, dtype, rank):
    if dtype == torch.bool:
        return (torch.arange(n, device=DEV) + rank) % 3 == 0
    return ((torch.arange(n, device=DEV) + 7 * rank) % 5).to(dtype)


@check("all_reduce every dtype, against arithmetic, Gloo and NCCL")
def _():
    for dtype in DTYPES:
        for n in (1, 1000, 1 << 20):
            want = ramp(n, dtype, 0)
            for r in range(1, WORLD):
                want = (want | ramp(n, dtype, r)) if dtype == torch.bool else want + ramp(n, dtype, r)
            t = ramp(n, dtype, RANK)
            dist.all_reduce(t, group=RUST)
            same(t, want, f"rustc10d all_reduce {dtype} n={n}")
            if dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
                g = ramp(n, dtype, RANK)
                dist.all_reduce(g, group=GLOO)
                same(t, g, f"against Gloo {dtype} n={n}")
            if NCCL is not None and dtype != torch.bool:
                c = ramp(n, dtype, RANK)
                dist.all_reduce(c, group=NCCL)
                same(t, c, f"against NCCL {dtype} n={n}")


@check("broadcast, all_gather_into_tensor, reduce_scatter_tensor")
def _():
    n = 1 << 18
    b = ramp(n, torch.float32, RANK)
    dist.broadcast(b, src=WORLD - 1, group=RUST)
    same(b, ramp(n, torch.float32, WORLD - 1), "broadcast")
    out = torch.empty(WORLD * n, device=DEV)
    dist.all_gather_into_tensor(out, ramp(n, torch.float32, RANK), group=RUST)
    same(out, torch.cat([ramp(n, torch.float32, r) for r in range(WORLD)]), "all_gather_into_tensor")
    for dtype in (torch.float32, torch.bfloat16):
        inp = torch.cat([ramp(n, dtype, RANK) + b for b in range(WORLD)])
        mine = torch.empty(n, device=DEV, dtype=dtype)
        dist.reduce_scatter_tensor(mine, inp, group=RUST)
        want = sum(ramp(n, torch.float32, r) + RANK for r in range(WORLD)).to(dtype)
        same(mine, want, f"reduce_scatter_tensor {dtype}")


@check("large all_reduce and broadcast, staged in pieces (RUSTC10D_STAGE_PIECE_BYTES)")
def _():
    # a little over 2 and 3 pieces of the default 8 MiB, so the last piece is short
    for n, dtype in (((1 << 21) + 3, torch.float32), ((3 << 22) + 5, torch.bfloat16)):
        t = ramp(n, dtype, RANK)
        dist.all_reduce(t, group=RUST)
        want = sum(ramp(n, torch.float32, r) for r in range(WORLD)).to(dtype)
        same(t, want, f"all_reduce in pieces {dtype} n={n}")
        b = ramp(n, dtype, RANK)
        dist.broadcast(b, src=0, group=RUST)
        same(b, ramp(n, dtype, 0), f"broadcast in pieces {dtype} n={n}")


@check("isend/irecv, both directions at once")
def _():
    peer = (RANK + 1) % WORLD
    src = (RANK - 1) % WORLD
    out = torch.full((4097,), float(RANK), device=DEV)
    got = torch.empty(4097, device=DEV)
    works = [dist.isend(out, peer, group=RUST), dist.irecv(got, src, group=RUST)]
    for w in works:
        w.wait()
    same(got, torch.full((4097,), float(src)), "irecv")


@check("stream order: producer on a side stream, collective, consumer, no host sync")
def _():
    side = torch.cuda.Stream(device=DEV)
    n = 1 << 22
    with torch.cuda.stream(side):
        a = torch.randn(2048, 2048, device=DEV)
        for _ in range(20):  # keep the stream busy, so a collective that ran early would read zeros
            a = (a @ a).clamp_(-1, 1)
        t = torch.zeros(n, device=DEV)
        t.add_(RANK + 1)  # the producer: only valid once the matmuls are done
        work = dist.all_reduce(t, group=RUST, async_op=True)
        work.wait()  # orders `side` after the result; must not block the host on the GPU
        t.mul_(2)  # the consumer, queued on the same stream
        result = t.sum()
    side.synchronize()
    want = 2.0 * n * WORLD * (WORLD + 1) / 2
    if result.item() != want:
        raise AssertionError(f"sum {result.item()}, want {want}")
    fut_t = torch.ones(10, device=DEV)
    fut = dist.all_reduce(fut_t, group=RUST, async_op=True).get_future()
    same(fut.wait()[0], torch.full((10,), float(WORLD)), "future value")


STREAM_WAIT = os.environ.get("RUSTC10D_CUDA_WAIT") == "stream"


def busy(n=30):
    """Queue some 100 ms of matmuls on the current stream: what comes after it waits."""
    a = torch.randn(4096, 4096, device=DEV)
    for _ in range(n):
        a = (a @ a).clamp_(-1, 1)
    return a


@check("wait() while the inputs are still being produced: the consumer sees the result")
def _():
    n = 16 << 20  # 64 MiB of float32: in pieces
    t = torch.zeros(n, device=DEV)
    busy()
    t.add_(RANK + 1)  # the producer, queued behind the matmuls
    work = dist.all_reduce(t, group=RUST, async_op=True)
    t0 = time.perf_counter()
    work.wait()
    waited_ms = (time.perf_counter() - t0) * 1e3
    t.mul_(2)  # the consumer, on the same stream
    got = t.sum().item()
    want = 2.0 * n * WORLD * (WORLD + 1) / 2
    print(f"WAIT rank {RANK} ({'stream' if STREAM_WAIT else 'host'}): wait() took {waited_ms:.2f} ms", flush=True)
    if got != want:
        raise AssertionError(f"sum {got}, want {want}")
    if STREAM_WAIT and waited_ms >= 1.0:
        raise AssertionError(f"a stream-ordered wait() blocked the host for {waited_ms:.2f} ms")


@check("a failed op (injected fault) leaves every tensor as it was")
def _():
    for n in (1000, (5 << 20) + 3):  # whole, and in pieces
        # rank 1 fails its first all_reduce on this group; every rank's op fails (fail fast)
        faulty = dist.new_group(backend="rustc10d", timeout=timedelta(seconds=60),
                                pg_options=rustc10d.Options(fault="rank=1,op=allreduce,seq=0,action=fail"))
        t = ramp(n, torch.float32, RANK)
        original = t.clone()
        busy(5)
        work = dist.all_reduce(t, group=faulty, async_op=True)
        try:
            work.wait()
            raised = False
        except Exception:  # noqa: BLE001 - any exception: the op failed
            raised = True
        torch.cuda.synchronize(DEV)
        deadline = time.monotonic() + 30
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.01)
        if work.is_success():
            raise AssertionError(f"n={n}: the op succeeded despite the fault")
        if not raised and not STREAM_WAIT:
            raise AssertionError(f"n={n}: wait() returned for a failed op")
        same(t, original, f"n={n}: the tensor after the failed op")
        later = ramp(10, torch.float32, RANK)
        try:
            dist.all_reduce(later, group=faulty)  # the group is broken: this fails too
            torch.cuda.synchronize(DEV)
        except Exception:  # noqa: BLE001
            pass
        same(later, ramp(10, torch.float32, RANK), f"n={n}: a later op's tensor")
        dist.destroy_process_group(faulty)


@check("a coalesced batch and batch_isend_irecv: the consumer on the stream sees the results")
def _():
    n = 1 << 22
    ts = [torch.zeros(n, device=DEV) for _ in range(3)]
    busy()
    for i, t in enumerate(ts):
        t.add_(RANK + i)
    with dist._coalescing_manager(group=RUST, device=DEV, async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, group=RUST)
    cm.wait()
    sums = torch.stack([t.sum() for t in ts]).tolist()  # the consumer, on the current stream
    want = [float(n * sum(r + i for r in range(WORLD))) for i in range(3)]
    if sums != want:
        raise AssertionError(f"coalesced sums {sums}, want {want}")
    peer, src = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    out = torch.empty(n, device=DEV)
    busy()
    out.fill_(float(RANK))
    got = torch.zeros(n, device=DEV)
    ops = [dist.P2POp(dist.isend, out, peer, group=RUST), dist.P2POp(dist.irecv, got, src, group=RUST)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    total = got.sum().item()
    if total != float(src * n):
        raise AssertionError(f"batch_isend_irecv received a sum of {total}, want {src * n}")


@check("isend/irecv while the send's input is still being produced: wait() and the consumer")
def _():
    n = 16 << 20
    peer, src = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    out, got = torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)
    busy()
    out.add_(RANK + 1)  # the producer, queued behind the matmuls
    t0 = time.perf_counter()
    works = [dist.isend(out, peer, group=RUST), dist.irecv(got, src, group=RUST)]
    for w in works:
        w.wait()
    waited_ms = (time.perf_counter() - t0) * 1e3
    total = got.sum().item()  # the consumer, on the same stream
    print(f"WAIT rank {RANK} ({'stream' if STREAM_WAIT else 'host'}): p2p wait() took {waited_ms:.2f} ms", flush=True)
    if total != float(n * (src + 1)):
        raise AssertionError(f"irecv received a sum of {total}, want {n * (src + 1)}")
    if STREAM_WAIT and waited_ms >= 1.0:
        raise AssertionError(f"stream-ordered isend/irecv wait() blocked the host for {waited_ms:.2f} ms")


@check("a batch while its inputs are still being produced: wait() and the consumer")
def _():
    n = 1 << 22
    peer, src = (RANK + 1) % WORLD, (RANK - 1) % WORLD
    ts = [torch.zeros(n, device=DEV) for _ in range(2)]
    out, got = torch.zeros(n, device=DEV), torch.zeros(n, device=DEV)
    busy()
    for i, t in enumerate(ts):
        t.add_(RANK + i)
    out.add_(RANK + 1)
    t0 = time.perf_counter()
    with dist._coalescing_manager(group=RUST, device=DEV, async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t, group=RUST)
    cm.wait()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer, group=RUST),
                                    dist.P2POp(dist.irecv, got, src, group=RUST)])
    for w in works:
        w.wait()
    waited_ms = (time.perf_counter() - t0) * 1e3
    sums = [t.sum().item() for t in ts] + [got.sum().item()]  # the consumers
    print(f"WAIT rank {RANK} ({'stream' if STREAM_WAIT else 'host'}): batches' wait() took {waited_ms:.2f} ms",
          flush=True)
    want = [float(n * sum(r + i for r in range(WORLD))) for i in range(2)] + [float(n * (src + 1))]
    if sums != want:
        raise AssertionError(f"sums {sums}, want {want}")
    if STREAM_WAIT and waited_ms >= 2.0:
        raise AssertionError(f"stream-ordered batches' wait() blocked the host for {waited_ms:.2f} ms")


@check("an op issued while the stream is captured into a CUDA graph is refused, naming it")
def _():
    t = torch.ones(1000, device=DEV)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device=DEV)
    message = ""
    try:
        with torch.cuda.graph(graph, stream=stream):
            dist.all_reduce(t, group=RUST)
    except RuntimeError as e:
        message = str(e)
    if "all" not in message or "captured" not in message:
        raise AssertionError(f"capture was not refused clearly: {message!r}")
    dist.all_reduce(t, group=RUST)  # the group is still usable
    same(t, torch.full((1000,), float(WORLD)), "all_reduce after a refused capture")


@check("DDP step on CUDA: replicas stay equal")
def _():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(DEV)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[DEV.index], process_group=RUST)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(RANK)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(32, 64, device=DEV)).square().mean().backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(everyone, flat, group=RUST)
    for r, x in enumerate(everyone):
        same(x, everyone[0], f"rank {r}'s parameters")


@check("DDP steps on CUDA: the same parameters as with Gloo")
def _():
    def train(group):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)).to(DEV)
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[DEV.index], process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        torch.manual_seed(100 + RANK)
        for _ in range(5):
            opt.zero_grad()
            ddp(torch.randn(32, 64, device=DEV)).square().mean().backward()
            opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    ours, gloo = train(RUST), train(GLOO)
    if not torch.allclose(ours, gloo, rtol=1e-5, atol=1e-6):
        raise AssertionError(f"max difference {(ours - gloo).abs().max().item()}")


@check("mixed CPU and CUDA tensors are refused clearly")
def _():
    out = [torch.empty(3, device=DEV)] + [torch.empty(3) for _ in range(WORLD - 1)]
    try:
        dist.all_gather(out, torch.ones(3, device=DEV), group=RUST)
    except Exception as e:  # noqa: BLE001
        if "same device" not in str(e):
            raise AssertionError(f"unclear error: {e}") from e
    else:
        raise AssertionError("mixed devices were accepted")
    t = torch.ones(3, device=DEV)
    dist.all_reduce(t, group=RUST)  # still usable
    same(t, torch.full((3,), float(WORLD)), "after the refusal")


def timed(group, n, iters=10):
    t = torch.ones(n, device=DEV)
    dist.all_reduce(t, group=group)
    torch.cuda.synchronize(DEV)
    dist.barrier(group=CPU)
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(t, group=group)
    torch.cuda.synchronize(DEV)
    return (time.perf_counter() - t0) / iters


@check("busbw against Gloo's CUDA path (all_reduce float32)")
def _():
    for n in (1 << 18, 1 << 22, 1 << 24):
        r, g = timed(RUST, n), timed(GLOO, n)
        bus = 2 * (WORLD - 1) / WORLD * 4 * n / 1e9
        if RANK == 0:
            print(f"BUSBW {4 * n >> 20} MiB: rustc10d {bus / r:.2f} GB/s, gloo {bus / g:.2f} GB/s, "
                  f"ratio {g / r:.2f}", flush=True)


# Last: Gloo may lack an op FSDP2 needs on CUDA, and a failure could leave its group unusable.
def batches(rank, steps):
    g = torch.Generator(device=DEV).manual_seed(100 + rank)
    return [torch.randn(64, 1024, device=DEV, generator=g) for _ in range(steps)]


def layers():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(DEV)


def fsdp2_train(group, steps):
    """fully_shard per layer and at the root, on CUDA; the parameters (whole) and the mean step time."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cuda")
    model = layers()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    xs = batches(RANK, steps)
    torch.cuda.synchronize(DEV)
    dist.barrier(group=CPU)
    t0 = time.perf_counter()
    for x in xs:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize(DEV)
    took = (time.perf_counter() - t0) / steps
    return torch.cat([p.full_tensor().detach().flatten() for p in model.parameters()]), took


@check("FSDP2 steps on CUDA: the same parameters as one process on every rank's batch, and the step time")
def _():
    steps = 10
    ours, ours_s = fsdp2_train(RUST, steps)
    model = layers()  # the reference: every rank's batch at once (the mean of equal means)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x in map(torch.cat, zip(*[batches(r, steps) for r in range(WORLD)])):
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    want = torch.cat([p.detach().flatten() for p in model.parameters()])
    try:
        _, gloo_s = fsdp2_train(GLOO, steps)
        gloo = f"gloo {gloo_s * 1e3:.2f} ms, ratio {gloo_s / ours_s:.2f}"
    except Exception as e:  # noqa: BLE001 - Gloo's CUDA path may lack an op FSDP2 needs
        gloo = f"gloo failed: {type(e).__name__}: {str(e)[:120]}"
    if RANK == 0:
        print(f"STEP FSDP2 ({'stream' if STREAM_WAIT else 'host'} wait): rustc10d {ours_s * 1e3:.2f} ms, {gloo}",
              flush=True)
    if not torch.allclose(ours, want, rtol=1e-4, atol=1e-5):
        raise AssertionError(f"max difference {(ours - want).abs().max().item()}")


dist.destroy_process_group()
print(f"rank {RANK}: {'FAILED: ' + ', '.join(FAILURES) if FAILURES else 'all CUDA checks passed'}", flush=True)
sys.exit(1 if FAILURES else 0)
