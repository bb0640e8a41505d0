"""Latency of small all_reduces, rustc10d side by side with Gloo and DeepSpeed's shared-memory
all_reduce, in one run (`python -m rustc10d.bench --latency`, or this module directly).

    python -m rustc10d.bench --latency                       # W = 2 and 4, 8 B .. 1 MiB
    python -m rustc10d.bench --latency --worlds 8,16 --sizes 8,4K,64K,1M,16M

Tensor-parallel inference does two small all_reduces per layer per token, so here the time of
one op is what counts, not bandwidth. Every rank times each op on its own (perf_counter, from
the call to its return); an op's time is the slowest rank's, and a cell is the median over the
ops (p90 in the JSON). Two ways of calling:

- back to back: the next op starts as soon as this rank has checked the last one's result and
  refilled its input, as in a layer with little compute between its all_reduces;
- after idle: each rank sleeps 2 ms (--idle-ms) before each op, as after a layer's compute, so
  that a backend whose threads go to sleep pays for waking them.

The series: rustc10d through `dist.all_reduce`; rustc10d-op, rustc10d's own torch op
(`rustc10d.all_reduce_`, one dispatcher call and no Work, as DeepSpeed's op is); all_reducer,
the same op bound once to the group (`rustc10d.all_reducer`), called with the tensor alone and
no dispatcher; Gloo; DeepSpeed. Each is called through one Python function, as DeepSpeed's is.

The series alternate in rounds, so that drift of the machine hits all alike. Every op's result is
checked against arithmetic (SUM of rank + 1 over ranks, exact in bfloat16); a wrong one fails the
run. A world size larger than the machine's CPU count is marked oversubscribed: ranks then share
cores, where spinning on a flag costs the rank that holds the core.

DeepSpeed's `inference_all_reduce` (its shm.cpp: SUM of float32/bfloat16 on one host, in the
caller's thread, spinning on flags in shared memory) runs when deepspeed is importable and ninja
is on the PATH (`pip install deepspeed ninja`): the launcher builds the op once (about two minutes
the first time, cached by torch under ~/.cache/torch_extensions) and every rank loads it with
LOCAL_SIZE set to the world size and DS_ACCELERATOR=cpu. Where deepspeed cannot be installed (no
network, no compiler), `--deepspeed-op PATH` loads that op built elsewhere against the same torch
and Python (its deepspeed_shm_comm.so, a build of DeepSpeed's csrc/cpu/comm/shm*.cpp).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

import rustc10d  # registers the "rustc10d" backend
from rustc10d import bench

MODULE = __spec__.name if __spec__ else "rustc10d.bench_latency"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MODES = ("back_to_back", "after_idle")
DEFAULT_SIZES = "8,4K,64K,1M"
DEEPSPEED = "deepspeed"
NO_KERNEL = "no kernel for this CPU"  # DeepSpeed's limit, reported, not a failure of the run


def _iterations(cfg: dict, size: int) -> int:
    """Ops per series and mode: cfg's count up to 64 KiB, fewer above (at least 20). The same on
    every rank: it depends on nothing a rank measures."""
    return int(max(20, cfg["iters"] * min(1.0, (64 << 10) / max(size, 1))))


# ----------------------------------------------------------------------------------------------
# One rank.

def _load_deepspeed_op(prebuilt: str | None):
    """DeepSpeed's shm op module: the prebuilt one at `prebuilt`, or built (cached) by deepspeed."""
    if prebuilt:
        spec = importlib.util.spec_from_file_location("deepspeed_shm_comm", prebuilt)
        op = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(op)  # registers torch.ops.deepspeed too
        return op
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().create_op_builder("ShareMemCommBuilder").load()


def _deepspeed_all_reduce(world: int, rank: int, port: int, prebuilt: str | None):
    """DeepSpeed's in-place shared-memory all_reduce (SUM), initialised for this job."""
    os.environ.update(LOCAL_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      DS_ACCELERATOR="cpu")
    op = _load_deepspeed_op(prebuilt)
    op.initialize(world, rank)
    level = op.vector_kernel_level()  # float32 needs avx2 (1), bfloat16 avx512bw (2)

    def run(t: torch.Tensor):
        if level < (1 if t.dtype == torch.float32 else 2):
                raise RuntimeError(f"{NO_KERNEL}: DeepSpeed's shm kernel for {t.dtype} needs avx2 (float32) "
                               "or avx512bw (bfloat16)")
        torch.ops.deepspeed.inference_all_reduce_(t)
    return run


def _switches() -> int:
    """Involuntary context switches of this thread so far (preemptions, and yields that ran another thread)."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def _sleeps(group) -> int:
    """How often a thread of rustc10d's `group` went to sleep waiting for an all_reduce so far."""
    return int(rustc10d.stats(group).get("allreduce", {}).get("wakeups", 0))


def _timed_ops(run, x: torch.Tensor, rank: int, want: torch.Tensor, iters: int, idle_s: float) -> tuple[list[int], str]:
    """`iters` ops, each on a refilled input and checked: each one's nanoseconds, and what was
    wrong ("" if nothing)."""
    times = []
    for i in range(iters):
        x.fill_(rank + 1)
        if idle_s:
            time.sleep(idle_s)
        t0 = time.perf_counter_ns()
        run(x)
        times.append(time.perf_counter_ns() - t0)
        if not torch.equal(x, want):
            bad = (x != want).nonzero().flatten()
            j = int(bad[0])
            return times, (f"op {i}: {len(bad)} of {x.numel()} elements wrong, first [{j}] = {x[j].item()}, "
                           f"expected {want[j].item()}")
    return times, ""


def worker_main(rank: int, world: int, port: int) -> int:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    cfg = json.loads(store.get("bench/config"))
    threading.Thread(target=bench._watch_parent, args=(time.monotonic() + cfg["timeout"],), daemon=True).start()
    timeout = timedelta(seconds=cfg["pg_timeout"])
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=3 * timeout)
    sync = dist.group.WORLD
    ours = dist.new_group(backend="rustc10d", timeout=timeout)
    gloo = dist.new_group(backend="gloo", timeout=timeout)
    ours_name = ours.group_name
    reducer = rustc10d.all_reducer(group=ours)
    runs = {"rustc10d": lambda t: dist.all_reduce(t, group=ours),
            # rustc10d.all_reduce_'s torch op, called as a hot loop would call it
            "rustc10d-op": lambda t: torch.ops.rustc10d.all_reduce_(t, ours_name, 0),
            # the same bound to the group once (rustc10d.all_reducer): no dispatcher
            "all_reducer": lambda t: reducer(t),
            "gloo": lambda t: dist.all_reduce(t, group=gloo)}
    if cfg["deepspeed"]:
        runs[DEEPSPEED] = _deepspeed_all_reduce(world, rank, port, cfg["deepspeed_op"])
    with open(cfg["results"], "a") if rank == 0 else open(os.devnull, "w") as results:
        for dtype_name, size in cfg["plan"]:
            dtype = DTYPES[dtype_name]
            n = max(1, size // dtype.itemsize)
            x = torch.empty(n, dtype=dtype)
            want = torch.full((n,), world * (world + 1) // 2, dtype=dtype)
            iters = _iterations(cfg, size)
            per_round = max(1, iters // cfg["rounds"])
            times = {(s, m): [] for s in runs for m in MODES}
            # Per series and mode, this rank's main thread: involuntary context switches (the
            # scheduler gave its core to another thread: a preemption, or a yield of rustc10d's
            # waits that let another thread run), and rustc10d's futex sleeps (its group's counters).
            preempted = {(s, m): 0 for s in runs for m in MODES}
            slept = {(s, m): 0 for s in runs for m in MODES}
            errors = {}
            for mode in MODES:
                idle_s = cfg["idle_ms"] / 1e3 if mode == "after_idle" else 0.0
                for name, run in runs.items():  # warm-up, unchecked timings
                    if name not in errors:
                        try:
                            _timed_ops(run, x, rank, want, 3, idle_s)
                        except Exception as e:  # noqa: BLE001 - reported; the series is skipped
                            errors[name] = f"{type(e).__name__}: {e}"
                for _ in range(cfg["rounds"]):
                    for name, run in runs.items():
                        if name in errors:
                            continue
                        dist.barrier(group=sync)
                        switches, sleeps = _switches(), _sleeps(ours)
                        try:
                            got, error = _timed_ops(run, x, rank, want, per_round, idle_s)
                        except Exception as e:  # noqa: BLE001
                            got, error = [], f"{type(e).__name__}: {e}"
                        times[(name, mode)] += got
                        preempted[(name, mode)] += _switches() - switches
                        slept[(name, mode)] += _sleeps(ours) - sleeps
                        if error:
                            errors[name] = error
                    # every rank must skip the same series from here on
                    every = [None] * world
                    dist.all_gather_object(every, errors, group=sync)
                    for e in every:
                        for name, why in e.items():
                            errors.setdefault(name, why)
            every = [None] * world
            mine = {f"{s}|{m}": (t, preempted[(s, m)], slept[(s, m)]) for (s, m), t in times.items()}
            dist.all_gather_object(every, mine, group=sync)
            entry = {"world": world, "op": "all_reduce", "dtype": dtype_name, "size": size,
                     "bytes": n * dtype.itemsize, "iters": iters, "errors": errors, "series": {}}
            for key in every[0]:
                ops = min(len(r[key][0]) for r in every)
                per_op = [max(r[key][0][i] for r in every) for i in range(ops)]
                if per_op:
                    # Summed over the ranks: how often, per op, some rank lost its core or slept
                    # (the series' warm-up ops are not counted, nor are times of ops left over).
                    entry["series"][key] = {"median_us": statistics.median(per_op) / 1e3,
                                            "p90_us": sorted(per_op)[int(0.9 * (len(per_op) - 1))] / 1e3,
                                            "ops": len(per_op),
                                            "preempted_per_op": sum(r[key][1] for r in every) / ops,
                                            "rustc10d_sleeps_per_op": sum(r[key][2] for r in every) / ops}
            results.write(json.dumps(entry) + "\n")
            results.flush()
        # What rustc10d's rank costs while nothing happens, every group connected.
        dist.barrier(group=sync)
        used = time.process_time()
        time.sleep(bench.IDLE_SECONDS)
        idle = torch.tensor([(time.process_time() - used) / bench.IDLE_SECONDS])
        dist.all_reduce(idle, op=dist.ReduceOp.MAX, group=sync)
        results.write(json.dumps({"world": world, "idle_cpu_fraction": idle.item()}) + "\n")
    dist.barrier(group=sync)
    dist.destroy_process_group()
    return 0


# ----------------------------------------------------------------------------------------------
# The launcher.

def deepspeed_ready(prebuilt: str | None = None) -> str | None:
    """None if DeepSpeed's shm all_reduce can run here (built now if it was not), else why not."""
    if prebuilt:
        try:
            _load_deepspeed_op(prebuilt)
        except Exception as e:  # noqa: BLE001 - reported; the run goes on without it
            return f"its prebuilt shm op {prebuilt} did not load: {type(e).__name__}: {str(e)[:300]}"
        return None
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install deepspeed ninja)"
    if shutil.which("ninja") is None:
        return "ninja is not on the PATH (pip install ninja, and put its bin/ on the PATH)"
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        from deepspeed.accelerator import get_accelerator
        get_accelerator().create_op_builder("ShareMemCommBuilder").load()
    except Exception as e:  # noqa: BLE001 - reported; the run goes on without it
        return f"its shm op did not build: {type(e).__name__}: {str(e)[:300]}"
    return None


def print_table(world: int, dtype: str, entries: list[dict], cpus: int):
    sizes = [e["bytes"] for e in entries]
    series = list(dict.fromkeys(k.split("|")[0] for e in entries for k in e["series"]))
    load = f"oversubscribed: {world} ranks on {cpus} CPUs" if world > cpus else f"{world} ranks on {cpus} CPUs"
    print(f"\nall_reduce SUM {dtype}  W={world} ({load}): median us per op, slowest rank")
    print(f"{'':<14}{'':<11}" + "".join(f"{bench._size(s):>11}" for s in sizes))
    for mode in MODES:
        label = "back to back" if mode == "back_to_back" else "after idle"
        for i, s in enumerate(series):
            cells = [e["series"].get(f"{s}|{mode}") for e in entries]
            print(f"{label if i == 0 else '':<14}{s:<11}"
                  + "".join(f"{c['median_us']:>11.1f}" if c else f"{'-':>11}" for c in cells))
        if DEEPSPEED in series:
            for ours, label in (("rustc10d-op", "op/ds"), ("all_reducer", "reducer/ds")):
                ratio = []
                for e in entries:
                    a, b = e["series"].get(f"{ours}|{mode}"), e["series"].get(f"{DEEPSPEED}|{mode}")
                    ratio.append(f"{a['median_us'] / b['median_us']:>11.2f}" if a and b else f"{'-':>11}")
                print(f"{'':<14}{label:<11}" + "".join(ratio))
    print("per op, summed over the ranks: times a rank's thread was switched out while runnable "
          "(preempted, or yielded to another thread) / rustc10d slept")
    for mode in MODES:
        label = "back to back" if mode == "back_to_back" else "after idle"
        for i, s in enumerate(series):
            cells = [e["series"].get(f"{s}|{mode}") for e in entries]
            print(f"{label if i == 0 else '':<14}{s:<11}"
                  + "".join(f"{c.get('preempted_per_op', 0):>6.2f}/{c.get('rustc10d_sleeps_per_op', 0):<4.2f}"
                            if c else f"{'-':>11}" for c in cells))
    for e in entries:
        for s, why in e["errors"].items():
            print(f"  {bench._size(e['bytes'])} {s}: {why[:300]}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rustc10d.bench --latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latency", action="store_true", help=argparse.SUPPRESS)  # how bench hands over
    p.add_argument("--worlds", default="2,4", help="world sizes (default 2,4)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"message sizes (default {DEFAULT_SIZES})")
    p.add_argument("--dtypes", default=",".join(DTYPES), help="float32, bfloat16 (default both)")
    p.add_argument("--iters", type=int, default=300, help="ops per series and mode up to 64 KiB (default 300)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds the ops are split into (default 5)")
    p.add_argument("--idle-ms", type=float, default=2.0, help="sleep before each op after idle, ms (default 2)")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even where it is installed")
    p.add_argument("--deepspeed-op", metavar="PATH",
                   help="DeepSpeed's shm op prebuilt for this torch and Python (deepspeed_shm_comm.so), "
                        "instead of deepspeed's own build")
    p.add_argument("--pg-timeout", type=float, default=60, help="process group timeout, s")
    p.add_argument("--timeout", type=float, default=1800, help="give up on one world size after this many s")
    p.add_argument("--json", type=Path, default=Path("bench-out/latency.json"),
                   help="results (default bench-out/latency.json)")
    p.add_argument("--worker", nargs=3, type=int, metavar=("RANK", "WORLD", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.worlds = [int(w) for w in args.worlds.split(",")]
    args.sizes = [bench.parse_size(s) for s in args.sizes.split(",")]
    args.dtypes = args.dtypes.split(",")
    for name in args.dtypes:
        if name not in DTYPES:
            p.error(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    if any(w < 2 for w in args.worlds):
        p.error("world sizes must be at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(*args.worker)
    prebuilt = str(Path(args.deepspeed_op).resolve()) if args.deepspeed_op else None
    why_no_ds = "left out (--no-deepspeed)" if args.no_deepspeed else deepspeed_ready(prebuilt)
    cpus = os.cpu_count() or 1
    cfg = {"plan": [(d, s) for d in args.dtypes for s in args.sizes], "iters": args.iters, "rounds": args.rounds,
           "idle_ms": args.idle_ms, "deepspeed": why_no_ds is None, "deepspeed_op": prebuilt, "pg_timeout": args.pg_timeout,
           "timeout": args.timeout}
    print(f"rustc10d {rustc10d.__version__} latency vs Gloo"
          + (" and DeepSpeed's shm all_reduce" if why_no_ds is None else "")
          + f", torch {torch.__version__}, {cpus} CPUs; W={args.worlds}")
    if why_no_ds:
        print(f"DeepSpeed: {why_no_ds}")
    results, failures, idle = [], [], {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rustc10d-latency-") as workdir:
        for world in args.worlds:
            def progress(e):
                cells = "  ".join(f"{k} {v['median_us']:.1f}" for k, v in e["series"].items())
                print(f"  W={e['world']} {e['dtype']} {bench._size(e['bytes'])}: {cells}", file=sys.stderr, flush=True)
            got, failure = bench.run_world(world, cfg, Path(workdir), progress, module=MODULE)
            idle.update({world: e["idle_cpu_fraction"] for e in got if "idle_cpu_fraction" in e})
            got = [e for e in got if "op" in e]
            results += got
            if failure:
                failures.append(failure)
            for dtype in args.dtypes:
                print_table(world, dtype, [e for e in got if e["dtype"] == dtype], cpus)
    for world, fraction in idle.items():
        print(f"idle: W={world}, no op for {bench.IDLE_SECONDS:g} s: the busiest rank used "
              f"{100 * fraction:.2f} % of a core")
    # A wrong result or an error fails the run, but for DeepSpeed lacking a kernel for this CPU
    # (reported in the table, and left out).
    wrong = [f"W={e['world']} {e['dtype']} {bench._size(e['bytes'])} {s}: {why}"
             for e in results for s, why in e["errors"].items() if NO_KERNEL not in why]
    report = {"meta": {"rustc10d": rustc10d.__version__, "torch": torch.__version__, "cpus": cpus,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:],
                       "seconds": round(time.monotonic() - t0, 1), "deepspeed": why_no_ds or "ran",
                       "config": {k: v for k, v in cfg.items() if k != "plan"}},
              "idle_cpu_fraction": idle, "ok": not wrong and not failures, "failures": wrong + failures,
              "results": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"\nresults: {args.json}\ntook {report['meta']['seconds']} s")
    if report["failures"]:
        print("\nLATENCY BENCHMARK FAILED:\n" + "\n".join(report["failures"]), file=sys.stderr)
        return 1
    print("every op's result checked against arithmetic: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
