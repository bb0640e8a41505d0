"""Side-by-side benchmark of rustc10d and Gloo on CPU tensors.

    python -m rustc10d.bench                 # W = 2 and 4, 8 B .. 256 MiB (minutes)
    python -m rustc10d.bench --quick         # W = 2, 8 B .. 4 MiB (about 2 minutes)
    python -m rustc10d.bench --latency       # small all_reduces, per op, with DeepSpeed's if installed
                                             # (rustc10d.bench_latency; --latency --help)

For each world size W this process hosts a TCPStore on a port the OS picks (no free-port race)
and starts W ranks (`python -m rustc10d.bench --worker ...`) that each hold the default Gloo group
(barriers and agreeing on timings, never timed) plus the groups under test: rustc10d once per
transport (--transports; all ranks share this host, so "shm" is shared memory and "tcp" loopback
TCP) and Gloo. For every (op, dtype, size) they are timed in alternating rounds (rustc10d-shm,
rustc10d-tcp, gloo, rustc10d-shm, ...) so that machine drift hits all alike. At the end the ranks
sit idle for a while and report the CPU they used meanwhile (an idle rank should use none).

Conventions of nccl-tests: warm-up iterations, then an adaptive number of timed iterations so a
measurement takes about --budget seconds; the time of an op is the slowest rank's (MAX over ranks);
algbw = bytes / time and busbw = algbw * factor (all_reduce 2(W-1)/W, all_gather, reduce_scatter
and all_to_all (W-1)/W, broadcast 1; the ping-pong's time is half a round trip). "bytes" is the
larger per-rank buffer: all_gather's output, reduce_scatter's and all_to_all's input, the gather's
output and the scatter's input at the root. After the
timing, every backend runs each op once more on fresh data and the result is checked against
arithmetic; a failed check is reported loudly and makes the exit code 1. That call also gives
rustc10d's costs that do not depend on the machine (`rustc10d.stats()`): bytes each rank copied
per payload byte, and how often a waiting thread slept; the tables show the busiest rank's, the
JSON every rank's.

Across hosts (--hosts H, root and iproute2 needed): the launcher builds H network namespaces
joined by a bridge (rustc10d.testbed.Hosts), each link capped at --link-gbit each way with tc,
and starts the W ranks inside them, W/H per host: ranks 0..W/H-1 on host 0 and so on, or rank r
on host r % H with --interleave. Ranks advertise their host's link (GLOO_SOCKET_IFNAME and
RUSTC10D_SOCKET_IFNAME are rc0), rank 0 hosts the TCPStore at host 0's address, and the config
comes in a file. The series are rustc10d-auto (shared memory inside a host, TCP across: what
users get) and gloo. Around the checked call the first rank of each host reads how many bytes
its host sent over its link (rc0's tx_bytes: Ethernet, IP and TCP headers and ACKs included),
less what an empty window of the same Gloo barriers sent; the tables' "link B/B" is the busiest
host's per payload byte ("bytes" as above), the JSON has every host's. A hierarchical
all_reduce sends 2(H-1)/H per byte.

    python -m rustc10d.bench --hosts 2 --link-gbit 2 --worlds 4 --max-size 4M --plot none
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

import rustc10d  # registers the "rustc10d" backend
from rustc10d.testbed import IFNAME, Hosts, TestbedUnavailable

BASELINE = "gloo"  # what every rustc10d series is compared with
COLORS = {"rustc10d-shm": "tab:red", "rustc10d-auto": "tab:red", "rustc10d-tcp": "tab:orange", BASELINE: "tab:blue"}
TRANSPORTS = ("shm", "tcp")
IDLE_SECONDS = 2.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LATENCY_MAX_BYTES = 64 * 1024  # the latency plot shows sizes up to this
MODULE = __spec__.name if __spec__ else "rustc10d.bench"  # what the ranks run: this very module
# --hosts: where a rank finds its config and the store (rank 0 hosts it on this port of host 0)
CONFIG_VAR, STORE_VAR, HOSTS_STORE_PORT = "RUSTC10D_BENCH_CONFIG", "RUSTC10D_BENCH_STORE", 29500
TX_BYTES = Path(f"/sys/class/net/{IFNAME}/statistics/tx_bytes")  # as seen from inside a host


# ----------------------------------------------------------------------------------------------
# The ops. Buffers are filled with small integers, exact in bfloat16 even after summing over
# ranks, so every check is an exact comparison.

def _pattern(n: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    """(i % 13) + offset for i < n."""
    return torch.arange(13, dtype=dtype).repeat(-(-n // 13))[:n] + offset


def _sum_pattern(n: int, dtype: torch.dtype, world: int) -> torch.Tensor:
    """Sum over ranks r of _pattern(n, dtype, r + 1)."""
    return _pattern(n, dtype, 0) * world + world * (world + 1) // 2


def _diff(what: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero().flatten()
    i = int(bad[0]) if len(bad) else 0
    return (f"{what}: {len(bad)} of {got.numel()} elements wrong, first at [{i}]: "
            f"got {got[i].item()}, expected {want[i].item()}")


def _make_all_reduce(n, dtype, rank, world):
    return {"x": _pattern(n, dtype, rank + 1)}


def _run_all_reduce(b, group, rank, world):
    dist.all_reduce(b["x"], op=dist.ReduceOp.SUM, group=group)


def _check_all_reduce(b, rank, world):
    return _diff("all_reduce result", b["x"], _sum_pattern(len(b["x"]), b["x"].dtype, world))


def _make_all_gather(n, dtype, rank, world):
    return {"x": _pattern(n // world, dtype, rank + 1), "y": torch.empty(n, dtype=dtype)}


def _run_all_gather(b, group, rank, world):
    dist.all_gather_into_tensor(b["y"], b["x"], group=group)


def _check_all_gather(b, rank, world):
    m = len(b["x"])
    return _diff("all_gather output", b["y"], torch.cat([_pattern(m, b["y"].dtype, r + 1) for r in range(world)]))


def _make_reduce_scatter(n, dtype, rank, world):
    return {"x": _pattern(n, dtype, rank + 1), "y": torch.empty(n // world, dtype=dtype)}


def _run_reduce_scatter(b, group, rank, world):
    dist.reduce_scatter_tensor(b["y"], b["x"], op=dist.ReduceOp.SUM, group=group)


def _check_reduce_scatter(b, rank, world):
    m = len(b["y"])
    want = _sum_pattern(m * world, b["y"].dtype, world)[rank * m:(rank + 1) * m]
    return _diff("reduce_scatter output", b["y"], want)


def _make_broadcast(n, dtype, rank, world):
    return {"x": _pattern(n, dtype, 1) if rank == 0 else torch.full((n,), -1, dtype=dtype)}


def _run_broadcast(b, group, rank, world):
    dist.broadcast(b["x"], src=0, group=group)


def _check_broadcast(b, rank, world):
    return _diff("broadcast result", b["x"], _pattern(len(b["x"]), b["x"].dtype, 1))


def _make_gather(n, dtype, rank, world):
    y = [torch.empty(n // world, dtype=dtype) for _ in range(world)] if rank == 0 else None
    return {"x": _pattern(n // world, dtype, rank + 1), "y": y}


def _run_gather(b, group, rank, world):
    dist.gather(b["x"], b["y"], dst=0, group=group)


def _check_gather(b, rank, world):
    if b["y"] is None:
        return None
    m = len(b["x"])
    return _diff("gather output", torch.cat(b["y"]), torch.cat([_pattern(m, b["x"].dtype, r + 1) for r in range(world)]))


def _make_scatter(n, dtype, rank, world):
    x = list(_pattern(n, dtype, 1).view(world, -1).clone().unbind()) if rank == 0 else None
    return {"x": x, "y": torch.full((n // world,), -1, dtype=dtype)}


def _run_scatter(b, group, rank, world):
    dist.scatter(b["y"], b["x"], src=0, group=group)


def _check_scatter(b, rank, world):
    m = len(b["y"])
    return _diff("scatter output", b["y"], _pattern(m * world, b["y"].dtype, 1)[rank * m:(rank + 1) * m])


def _a2a_input(n, dtype, world, src):
    """Rank src's input: block d, for rank d, is the pattern's block d plus 16 src + d."""
    blocks = _pattern(n, dtype, 0).view(world, -1)
    return (blocks + (16 * src + torch.arange(world, dtype=dtype))[:, None]).flatten()


def _make_all_to_all(n, dtype, rank, world):
    return {"x": _a2a_input(n, dtype, world, rank), "y": torch.empty(n, dtype=dtype)}


def _run_all_to_all(b, group, rank, world):
    dist.all_to_all_single(b["y"], b["x"], group=group)


def _check_all_to_all(b, rank, world):
    n, dtype = len(b["y"]), b["y"].dtype
    mine = _pattern(n, dtype, 0).view(world, -1)[rank]  # every source's block for this rank
    want = (mine + (16 * torch.arange(world, dtype=dtype) + rank)[:, None]).flatten()
    return _diff("all_to_all output", b["y"], want)


def _make_pingpong(n, dtype, rank, world):
    # rank 0 sends x and receives the echo in y; rank 1 receives into y and sends y back
    if rank == 0:
        return {"x": _pattern(n, dtype, 1), "y": torch.full((n,), -1, dtype=dtype)}
    return {"y": torch.full((n,), -1, dtype=dtype)} if rank == 1 else {}


def _run_pingpong(b, group, rank, world):
    if rank == 0:
        dist.send(b["x"], dst=1, group=group)
        dist.recv(b["y"], src=1, group=group)
    elif rank == 1:
        dist.recv(b["y"], src=0, group=group)
        dist.send(b["y"], dst=0, group=group)


def _check_pingpong(b, rank, world):
    if "y" not in b:
        return None
    return _diff("ping-pong " + ("echo" if rank == 0 else "message"), b["y"], _pattern(len(b["y"]), b["y"].dtype, 1))


@dataclass(frozen=True)
class Op:
    make: Callable  # (elements, dtype, rank, world) -> buffers, inputs filled with the check pattern
    run: Callable  # (buffers, group, rank, world): one iteration
    check: Callable  # (buffers, rank, world) -> None, or what is wrong
    busbw: Callable[[int], float]  # busbw / algbw for world size W
    dtypes: tuple[str, ...] = ("float32",)
    chunked: bool = False  # the element count must split evenly over the ranks
    round_trip: bool = False  # an iteration is a round trip: report half of it


OPS: dict[str, Op] = {
    "all_reduce": Op(_make_all_reduce, _run_all_reduce, _check_all_reduce,
                     lambda w: 2 * (w - 1) / w, dtypes=("float32", "bfloat16")),
    "all_gather_into_tensor": Op(_make_all_gather, _run_all_gather, _check_all_gather,
                                 lambda w: (w - 1) / w, chunked=True),
    "reduce_scatter_tensor": Op(_make_reduce_scatter, _run_reduce_scatter, _check_reduce_scatter,
                                lambda w: (w - 1) / w, dtypes=("float32", "bfloat16"), chunked=True),
    "broadcast": Op(_make_broadcast, _run_broadcast, _check_broadcast, lambda w: 1.0),
    "gather": Op(_make_gather, _run_gather, _check_gather, lambda w: (w - 1) / w, chunked=True),
    "scatter": Op(_make_scatter, _run_scatter, _check_scatter, lambda w: (w - 1) / w, chunked=True),
    "all_to_all_single": Op(_make_all_to_all, _run_all_to_all, _check_all_to_all,
                            lambda w: (w - 1) / w, chunked=True),
    "pingpong": Op(_make_pingpong, _run_pingpong, _check_pingpong, lambda w: 1.0, round_trip=True),
}


def _elements(op: Op, dtype: torch.dtype, size: int, world: int) -> int:
    n = max(1, -(-size // dtype.itemsize))
    return -(-n // world) * world if op.chunked else n


# ----------------------------------------------------------------------------------------------
# One rank.

class BackendFailed(Exception):
    pass


@dataclass
class Rank:
    rank: int
    world: int
    cfg: dict
    sync: object  # the default Gloo group: barriers and agreement, never timed
    groups: dict  # series ("rustc10d-shm", ..., "gloo") -> group under test, in timing order
    host: int | None = None  # --hosts: this rank's host
    host_leader: bool = False  # --hosts: the first rank of its host, which reads the link's counter

    def agree(self, value: float, error: str) -> float:
        """MAX of value over ranks; raises BackendFailed on every rank if any rank had an error,
        so that all ranks take the same branch and the sync group's calls stay in step."""
        t = torch.tensor([value, 1.0 if error else 0.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.sync)
        if t[1] > 0:
            errors = [None] * self.world
            dist.all_gather_object(errors, error, group=self.sync)
            raise BackendFailed("; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e))
        return t[0].item()

    def timed(self, run, iters: int, warmup: int) -> float:
        """Seconds that `iters` iterations took on the slowest rank."""
        dist.barrier(group=self.sync)
        elapsed, error = 0.0, ""
        try:
            for _ in range(warmup):
                run()
            t0 = time.perf_counter()
            for _ in range(iters):
                run()
            elapsed = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - reported, and the backend is skipped for this op
            error = f"{type(e).__name__}: {e}".strip()
        return self.agree(elapsed, error)

    def calibrate(self, run) -> int:
        """Iterations that take about cfg['budget'] s; the first pass is also the warm-up."""
        budget, cap = self.cfg["budget"], self.cfg["max_iters"]
        n, warmup = 1, self.cfg["warmup"]
        while True:
            t = max(self.timed(run, n, warmup), 1e-7)  # the same t on every rank: same n
            warmup = 0
            if t >= budget / 4 or n >= cap:
                return max(1, min(cap, round(n * budget / t)))
            n = min(cap, max(2 * n, math.ceil(n * budget / 4 / t * 1.2)))

    def link_window(self, fn):
        """fn() on every rank, and the bytes this rank's host sent over its link meanwhile (on
        the first rank of each host; 0 on the others): (bytes, what fn returned). The sync
        group's barriers that fence fn off also cross the link: an empty window measures them."""
        dist.barrier(group=self.sync)
        start = int(TX_BYTES.read_text()) if self.host_leader else 0
        dist.barrier(group=self.sync)
        out = fn()
        dist.barrier(group=self.sync)
        return (int(TX_BYTES.read_text()) - start if self.host_leader else 0), out

    def bench(self, name: str, dtype_name: str, size: int) -> dict:
        op, dtype = OPS[name], DTYPES[dtype_name]
        n = _elements(op, dtype, size, self.world)
        bufs = op.make(n, dtype, self.rank, self.world)
        out = {b: {"status": "ok", "iters": 0, "times_s": []} for b in self.groups}
        for _ in range(self.cfg["rounds"]):
            for b, res in out.items():
                if res["status"] != "ok":
                    continue
                run = partial(op.run, bufs, self.groups[b], self.rank, self.world)
                try:
                    res["iters"] = res["iters"] or self.calibrate(run)
                    t = self.timed(run, res["iters"], min(self.cfg["warmup"], res["iters"]))
                    res["times_s"].append(t / res["iters"] / (2 if op.round_trip else 1))
                except BackendFailed as e:
                    # Gloo lacks some ops/dtypes: that is Gloo's limit, not a failure of the run
                    res.update(status="unsupported" if b == BASELINE else "error", error=str(e))
        del bufs
        for b, res in out.items():
            if res["status"] == "ok":  # once more on fresh buffers, checked against arithmetic
                bufs = op.make(n, dtype, self.rank, self.world)
                dist.barrier(group=self.sync)
                ours = b != BASELINE
                # the least of a few empty windows: traffic that is not the op's (a delayed ACK, a
                # Store poll) lands in some windows and not others, and must not be taken off the op's
                fences = min(self.link_window(lambda: None)[0] for _ in range(3)) if self.host is not None else 0
                before = _cost(self.groups[b]) if ours else None
                call = partial(_attempt, partial(op.run, bufs, self.groups[b], self.rank, self.world))
                sent, error = self.link_window(call) if self.host is not None else (0, call())
                if not error:
                    try:
                        error = op.check(bufs, self.rank, self.world) or ""
                    except Exception as e:  # noqa: BLE001
                        error = f"{type(e).__name__}: {e}"
                if ours:  # what this one call cost each rank, in counts independent of the machine
                    spent = {k: v - before[k] for k, v in _cost(self.groups[b]).items()}
                    every = [None] * self.world
                    dist.all_gather_object(every, spent, group=self.sync)
                    res["cost"] = {k: [r[k] for r in every] for k in spent}
                if self.host is not None:  # what each host sent over its link, fences taken off
                    every = [None] * self.world
                    dist.all_gather_object(every, (self.host, sent - fences, fences) if self.host_leader else None,
                                           group=self.sync)
                    hosts = sorted(x for x in every if x)
                    net = [max(0, s) for _, s, _ in hosts]
                    res["link"] = {"tx_bytes": net, "fence_bytes": [f for _, _, f in hosts],
                                   "per_byte": max(net) / max(n * dtype.itemsize, 1)}
                try:
                    self.agree(0.0, error)
                except BackendFailed as e:
                    res.update(status="check_failed", error=str(e))
                del bufs
        return {"world": self.world, "op": name, "dtype": dtype_name, "size": size,
                "bytes": n * dtype.itemsize, "busbw_factor": op.busbw(self.world), "backends": out}


def _attempt(run) -> str:
    """run(), and what went wrong ("" if nothing did)."""
    try:
        run()
    except Exception as e:  # noqa: BLE001 - reported, and the check fails
        return f"{type(e).__name__}: {e}"
    return ""


def _cost(group) -> dict:
    """This rank's copied bytes, wake-ups and early bytes over every op kind of a rustc10d group."""
    kinds = rustc10d.stats(group).values()
    return {k: sum(s[k] for s in kinds) for k in ("copied_bytes", "wakeups", "early_bytes")}


def _watch_parent(deadline: float):
    """End this rank if the launcher dies or the job's deadline passes: no orphans."""
    parent = os.getppid()
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(1)
    os._exit(3)


def worker_main(rank: int, world: int, port: int) -> int:
    torch.set_num_threads(1)  # W ranks share the machine's cores, as the tests do
    if os.environ.get(CONFIG_VAR):  # --hosts: in a namespace, where the launcher's store is out of reach
        store = dist.TCPStore(os.environ[STORE_VAR], port, world, is_master=rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        cfg = json.loads(Path(os.environ[CONFIG_VAR]).read_text())
    else:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
        cfg = json.loads(store.get("bench/config"))
    threading.Thread(target=_watch_parent, args=(time.monotonic() + cfg["timeout"],), daemon=True).start()
    pg_timeout = timedelta(seconds=cfg["pg_timeout"])
    # the sync group waits out a backend's failing op (up to pg_timeout) before it can agree
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=3 * pg_timeout)
    groups = {}
    for t in cfg["transports"]:
        # One series per value of a varied setting (--nsocks, --arena-slot-bytes), else one.
        field, label, values = cfg.get("vary") or (None, "", [[None, ""]])
        for v, text in values:
            os.environ["RUSTC10D_TRANSPORT"] = t  # read when the group is created
            options = rustc10d.Options(**{field: v}) if v is not None else None
            name = f"rustc10d-{t}" + (f"-{label}{text}" if v is not None else "")
            groups[name] = dist.new_group(backend="rustc10d", timeout=pg_timeout, pg_options=options)
    groups[BASELINE] = dist.new_group(backend=BASELINE, timeout=pg_timeout)
    me = Rank(rank, world, cfg, dist.group.WORLD, groups)
    if "host_of" in cfg:
        me.host = cfg["host_of"][rank]
        me.host_leader = cfg["host_of"].index(me.host) == rank
    with open(cfg["results"], "a") if rank == 0 else open(os.devnull, "w") as results:
        for name, dtype_name, size in cfg["plan"]:
            results.write(json.dumps(me.bench(name, dtype_name, size)) + "\n")
            results.flush()  # the launcher shows progress from this file
        # Every group is connected by now; see what the rank costs while nothing happens.
        dist.barrier(group=me.sync)
        used = _cpu_seconds()
        time.sleep(IDLE_SECONDS)
        idle = torch.tensor([(_cpu_seconds() - used) / IDLE_SECONDS])
        dist.all_reduce(idle, op=dist.ReduceOp.MAX, group=me.sync)
        results.write(json.dumps({"world": world, "idle_cpu_fraction": idle.item()}) + "\n")
    dist.barrier(group=me.sync)
    dist.destroy_process_group()
    return 0


def _cpu_seconds() -> float:
    """CPU time of this process so far: all its threads, user and system, to the nanosecond."""
    return time.process_time()


# ----------------------------------------------------------------------------------------------
# The launcher.

def host_of(world: int, hosts: int, interleave: bool) -> list[int]:
    """The host of each rank: blocks of world/hosts consecutive ranks, or round robin."""
    return [r % hosts if interleave else r // (world // hosts) for r in range(world)]


def run_world(world: int, cfg: dict, workdir: Path, on_result,
              hosts: Hosts | None = None, module: str = MODULE) -> tuple[list[dict], str | None]:
    """Start `world` ranks of `module` (`python -m module --worker ...`; inside `hosts'`
    namespaces, if given) and wait for them; returns their results and, if the job failed, why."""
    results = workdir / f"w{world}.jsonl"
    results.touch()
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if hosts is None:
        store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=60))
        store.set("bench/config", json.dumps(dict(cfg, results=str(results))))
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this machine
        port, where = store.port, []
    else:  # rank 0 hosts the store at host 0's address; each world its own port (no TIME_WAIT)
        where = host_of(world, hosts.count, cfg["interleave"])
        config = workdir / f"w{world}-config.json"
        config.write_text(json.dumps(dict(cfg, results=str(results), host_of=where)))
        env.update({CONFIG_VAR: str(config), STORE_VAR: hosts.addrs[0], "GLOO_SOCKET_IFNAME": IFNAME,
                    "RUSTC10D_SOCKET_IFNAME": IFNAME})
        port = HOSTS_STORE_PORT + world
    procs, logs = [], []
    for rank in range(world):
        log = workdir / f"w{world}-rank{rank}.log"
        logs.append(log)
        argv = [sys.executable, "-m", module, "--worker", str(rank), str(world), str(port)]
        with open(log, "wb") as f:
            procs.append(subprocess.Popen(argv if hosts is None else hosts.command(where[rank], argv),
                                          env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
    got, offset, failure = [], 0, None
    deadline = time.monotonic() + cfg["timeout"]
    try:
        while True:
            done = all(p.poll() is not None for p in procs)
            with open(results) as f:  # whole lines only: a rank may be writing one
                f.seek(offset)
                for line in iter(f.readline, ""):
                    if not line.endswith("\n"):
                        break
                    offset += len(line)
                    got.append(json.loads(line))
                    if "op" in got[-1]:
                        on_result(got[-1])
            if done:
                break
            if time.monotonic() > deadline:
                failure = f"W={world}: still running after {cfg['timeout']} s (--timeout), stopped"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    codes = [p.returncode for p in procs]
    if failure is None and any(codes):
        failure = f"W={world}: ranks exited with codes {codes}"
    if failure:
        for log in logs:
            tail = log.read_text(errors="replace")[-2000:]
            failure += f"\n--- {log.name} (last 2000 characters)\n{tail}"
    return got, failure


# ----------------------------------------------------------------------------------------------
# The machine's limits, to read busbw against.

def memcpy_bandwidth(nbytes: int, reps: int = 8) -> float:
    """Bytes per second that one core copies (best of reps)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)  # fault the pages in
        best = math.inf
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best
    finally:
        torch.set_num_threads(threads)


def _tcp_sink(port: int, total: int, reps: int):
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf = memoryview(bytearray(4 << 20))
        for _ in range(reps):
            left = total
            while left:
                got = s.recv_into(buf, min(len(buf), left))
                if not got:
                    return
                left -= got
            s.sendall(b"k")  # the sender stops its clock on this


def tcp_loopback_bandwidth(total: int, reps: int = 3) -> float:
    """Bytes per second between two processes over 127.0.0.1 (best of reps)."""
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if "fork" in methods else "spawn")  # fork: no re-import
    with socket.create_server(("127.0.0.1", 0)) as server:
        sink = ctx.Process(target=_tcp_sink, args=(server.getsockname()[1], total, reps), daemon=True)
        sink.start()
        server.settimeout(60)
        conn, _ = server.accept()
    chunk = memoryview(bytearray(4 << 20))
    best = math.inf
    with conn:
        conn.settimeout(60)
        for _ in range(reps):
            t0 = time.perf_counter()
            left = total
            while left:
                n = min(len(chunk), left)
                conn.sendall(chunk[:n])
                left -= n
            conn.recv(1)
            best = min(best, time.perf_counter() - t0)
    sink.join(10)
    return total / best


# ----------------------------------------------------------------------------------------------
# Reporting.

def _stats(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(entry: dict) -> dict:
    """Add time, algbw and busbw statistics over rounds, and for each rustc10d series the
    per-round ratio gloo time / its time (= its busbw / gloo's: > 1 means rustc10d is faster)."""
    for res in entry["backends"].values():
        if res["times_s"]:
            res["time_s"] = t = _stats(res["times_s"])
            # from the time's statistics, so that a row's time and busbw agree for any round count
            for key, factor in (("algbw_GBps", 1), ("busbw_GBps", entry["busbw_factor"])):
                res[key] = {k: entry["bytes"] * factor / 1e9 / t[other]
                            for k, other in (("min", "max"), ("median", "median"), ("max", "min"))}
    g = entry["backends"][BASELINE]
    entry["ratio"] = {b: _stats([tg / tr for tr, tg in zip(r["times_s"], g["times_s"])])
                      for b, r in entry["backends"].items()
                      if b != BASELINE and r["status"] == g["status"] == "ok" and r["times_s"]}
    return entry


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _time(s: float) -> str:
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.3f} s"


def _cells(res: dict) -> str:
    """time and busbw (medians over rounds), or why there are none; FAIL: the check failed."""
    if res.get("time_s"):
        flag = "FAIL" if res["status"] == "check_failed" else ""
        return f"{_time(res['time_s']['median']):>10} {res['busbw_GBps']['median']:>10.3f} {flag:<4}"
    return f"{res['status']:>26}"


def _cost_cell(entry: dict, res: dict) -> str:
    """The busiest rank's bytes copied per payload byte, and its wake-ups, in one call."""
    cost = res.get("cost")
    if not cost:
        return f"{'-':^15}"
    copies = max(cost["copied_bytes"]) / max(entry["bytes"], 1)
    return f"{copies:8.2f} {max(cost['wakeups']):6d}"


def _link_cell(res: dict) -> str:
    """Bytes the busiest host sent over its link per payload byte, in the checked call."""
    link = res.get("link")
    return f"{link['per_byte']:10.3f}" if link else f"{'-':^10}"


def _series(entries: list[dict]) -> list[str]:
    return list(dict.fromkeys(b for e in entries for b in e["backends"]))


def print_table(world: int, name: str, dtype: str, entries: list[dict]):
    factor = OPS[name].busbw(world)
    series = _series(entries)
    ours = [b for b in series if b != BASELINE]
    linked = [b for b in series if any("link" in e["backends"][b] for e in entries)]  # --hosts
    print(f"\n{name} {dtype}  W={world}  busbw = algbw x {factor:.2f}"
          f"{'  time = half round trip' if OPS[name].round_trip else ''}")
    print(f"{'':>10} | " + " | ".join(f"{b:^26}" for b in series) + " | "
          + " | ".join(f"{'ratio ' + b.removeprefix('rustc10d-'):^19}" for b in ours) + " | "
          + " | ".join(f"{'cost ' + b.removeprefix('rustc10d-'):^15}" for b in ours)
          + "".join(f" | {'link ' + b.removeprefix('rustc10d-'):^10}" for b in linked))
    print(f"{'size':>10} | " + f"{'time':>10} {'busbw GB/s':>10} {'':4} | " * len(series)
          + " | ".join(f"{'min / median / max':^19}" for _ in ours) + " | "
          + " | ".join(f"{'copies/B wakes':^15}" for _ in ours)
          + "".join(f" | {'link B/B':^10}" for _ in linked))
    for e in entries:
        ratios = []
        for b in ours:
            r = e.get("ratio", {}).get(b)
            ratios.append(f"{r['min']:5.2f} /{r['median']:5.2f} /{r['max']:5.2f}" if r else f"{'-':^19}")
        costs = [_cost_cell(e, e["backends"][b]) for b in ours]
        print(f"{_size(e['bytes']):>10} | " + " | ".join(_cells(e["backends"][b]) for b in series) + " | "
              + " | ".join(ratios) + " | " + " | ".join(costs)
              + "".join(f" | {_link_cell(e['backends'][b])}" for b in linked))
    notes = {(b, res["status"], res["error"][:300]) for e in entries for b, res in e["backends"].items() if "error" in res}
    for b, status, error in sorted(notes):
        print(f"  {b} {status}: {error}")


def _groups(results: list[dict]) -> dict:
    """(world, op, dtype) -> entries, in run order."""
    out: dict = {}
    for e in results:
        out.setdefault((e["world"], e["op"], e["dtype"]), []).append(e)
    return out


def print_summary(results: list[dict], reference: dict):
    tcp = reference.get("tcp_loopback_GBps")
    print("\nSummary: peak busbw (GB/s, median over rounds) and its fraction of loopback TCP; "
          "latency = time at the smallest size")
    series = _series(results)
    print(f"{'W':>2} {'op':<24} {'dtype':<9} | "
          + " | ".join(f"{b + ' peak':>14} {'%tcp':>5} {'latency':>10}" for b in series))
    for (world, name, dtype), entries in _groups(results).items():
        cells = []
        for b in series:
            ok = [e for e in entries if e["backends"][b].get("busbw_GBps")]
            if not ok:
                cells.append(f"{'-':>14} {'':>5} {'':>10}")
                continue
            peak = max(e["backends"][b]["busbw_GBps"]["median"] for e in ok)
            pct = f"{100 * peak / tcp:4.0f}%" if tcp else ""
            cells.append(f"{peak:>14.3f} {pct:>5} {_time(ok[0]['backends'][b]['time_s']['median']):>10}")
        print(f"{world:>2} {name:<24} {dtype:<9} | " + " | ".join(cells))


def failures(results: list[dict]) -> list[str]:
    return [f"W={e['world']} {e['op']} {e['dtype']} {_size(e['bytes'])} {b}: {res['status']}: {res.get('error', '')}"
            for e in results for b, res in e["backends"].items() if res["status"] in ("error", "check_failed")]


def plot(report: dict, path: Path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}). pip install 'rustc10d[bench]' to get one.")
        return
    groups = _groups(report["results"])
    keys = list(dict.fromkeys((op, dtype) for _, op, dtype in groups))
    worlds = sorted({w for w, _, _ in groups})
    cols = 2 * len(worlds)  # busbw for each W, then latency for each W
    fig, axes = plt.subplots(len(keys), cols, figsize=(4.2 * cols, 2.8 * len(keys)), squeeze=False)
    ref = report["reference"]
    for i, (name, dtype) in enumerate(keys):
        for j, world in enumerate(worlds):
            entries = groups.get((world, name, dtype), [])
            bw_ax, lat_ax = axes[i][j], axes[i][len(worlds) + j]
            for b in _series(entries):
                color = COLORS.get(b, "tab:gray")
                ok = [e for e in entries if e["backends"][b].get("busbw_GBps")]
                xs = [e["bytes"] for e in ok]
                for ax, key, scale, limit in ((bw_ax, "busbw_GBps", 1, math.inf),
                                              (lat_ax, "time_s", 1e6, LATENCY_MAX_BYTES)):
                    pts = [(x, e["backends"][b][key]) for x, e in zip(xs, ok) if x <= limit]
                    if not pts:
                        continue
                    px = [x for x, _ in pts]
                    ax.plot(px, [s["median"] * scale for _, s in pts], "o-", ms=3, color=color, label=b)
                    ax.fill_between(px, [s["min"] * scale for _, s in pts], [s["max"] * scale for _, s in pts],
                                    color=color, alpha=0.2)
            for label, key, style in (("TCP loopback", "tcp_loopback_GBps", "--"), ("memcpy 1 core", "memcpy_1core_GBps", ":"),
                                      ("link, one stream", "link_GBps", "-.")):
                if ref.get(key):
                    bw_ax.axhline(ref[key], color="gray", ls=style, lw=1, label=label)
            for ax, what, unit in ((bw_ax, "busbw", "GB/s"), (lat_ax, "latency", "us")):
                ax.set_xscale("log", base=2)
                ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _size(int(round(x)))))
                ax.set_yscale("log")
                ax.set_title(f"{name} {dtype} W={world}: {what}", fontsize=9)
                ax.set_xlabel("bytes", fontsize=8)
                ax.set_ylabel(unit, fontsize=8)
                ax.tick_params(which="both", labelsize=7)
                ax.grid(True, which="major", alpha=0.3)
            plain = FuncFormatter(lambda y, _: f"{y:g}" if f"{y:g}"[0] in "125" else "")  # 200, not 2x10^2
            lat_ax.yaxis.set_major_formatter(plain)
            lat_ax.yaxis.set_minor_formatter(plain)
            if i == 0 and j == 0:
                bw_ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    print(f"plot: {path}")


# ----------------------------------------------------------------------------------------------
# Command line.

def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def sizes(lo: int, hi: int, step: int) -> list[int]:
    out = []
    while lo <= hi:
        out.append(lo)
        lo *= step
    return out + [hi] if out and out[-1] != hi else out


def _unique_prefix(name: str, known) -> str | None:
    """The one known name that starts with `name`, if exactly one does."""
    found = [k for k in known if k.startswith(name)]
    return found[0] if len(found) == 1 else None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rustc10d.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="W=2, 8 B..4 MiB, 3 rounds, short budget: a smoke run (under 2 minutes)")
    p.add_argument("--worlds", help="world sizes, e.g. 2,4 (default 2,4; quick: 2)")
    p.add_argument("--ops", default=",".join(OPS),
                   help="ops to run (default: all; a unique prefix will do, e.g. all_gather): " + ", ".join(OPS))
    p.add_argument("--transports",
                   help="rustc10d transports to time, each as a series of its own (default shm,tcp; --hosts: auto)")
    p.add_argument("--hosts", type=int,
                   help="run the ranks in H network namespaces joined by a bridge (root; see above); "
                        "every world size must be a multiple of H")
    p.add_argument("--link-gbit", type=float, help="--hosts: cap each host's link at this many Gbit/s each way")
    p.add_argument("--flow-gbit", type=float,
                   help="--hosts: cap each TCP connection at this many Gbit/s too, as one stream that cannot "
                        "fill a fast link (testbed.Hosts flow_gbit)")
    p.add_argument("--nsocks", help="rustc10d series per nsocks value, e.g. 1,auto (default: one, as configured)")
    p.add_argument("--arena-slot-bytes",
                   help="rustc10d series per arena_slot_bytes value, e.g. 0,1M (0: no arena; default: as configured)")
    p.add_argument("--encrypt", help="rustc10d series per encrypt value, e.g. 0,1 (1: TCP frames sealed; a secret "
                   "is made for the run unless RUSTC10D_SECRET or RUSTC10D_SECRET_FILE is set)")
    p.add_argument("--interleave", action="store_true",
                   help="--hosts: rank r on host r %% H (default: consecutive ranks on each host)")
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="dtypes to run, where an op has them (all_reduce and reduce_scatter: float32 and "
                        "bfloat16; the others float32)")
    p.add_argument("--min-size", type=parse_size, default=8, help="smallest message, e.g. 8, 1K (default 8 B)")
    p.add_argument("--max-size", type=parse_size, help="largest message, e.g. 4M (default 256M; quick: 4M)")
    p.add_argument("--step", type=int, default=4, help="size factor from one size to the next (default 4)")
    p.add_argument("--rounds", type=int, help="alternating rounds per backend (default 5; quick: 3)")
    p.add_argument("--budget", type=float, help="seconds of timed iterations per measurement (default 0.1; quick: 0.02)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up iterations before each measurement (default 2)")
    p.add_argument("--max-iters", type=int, default=10000, help="cap on timed iterations per measurement")
    p.add_argument("--pg-timeout", type=float, default=60, help="process group timeout, s (a hung op fails after this)")
    p.add_argument("--timeout", type=float, help="give up on one world size after this many s (default 3600; quick: 150)")
    p.add_argument("--json", type=Path, default=Path("bench-out/bench.json"), help="results (default bench-out/bench.json)")
    p.add_argument("--plot", default="bench-out/bench.png", help="PNG to draw, or 'none' (default bench-out/bench.png)")
    p.add_argument("--worker", nargs=3, type=int, metavar=("RANK", "WORLD", "PORT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    quick = args.quick
    args.worlds = [int(w) for w in (args.worlds or ("2" if quick else "2,4")).split(",")]
    args.max_size = args.max_size or (4 << 20 if quick else 256 << 20)
    args.rounds = args.rounds or (3 if quick else 5)
    args.budget = args.budget or (0.02 if quick else 0.1)
    args.timeout = args.timeout or (150 if quick else 3600)
    args.ops = [name if name in OPS else _unique_prefix(name, OPS) or name for name in args.ops.split(",")]
    args.transports = (args.transports or ("auto" if args.hosts else ",".join(TRANSPORTS))).split(",")
    for t in args.transports:
        if t not in ("auto",) + TRANSPORTS:
            p.error(f"unknown transport {t!r}; known: auto, {', '.join(TRANSPORTS)}")
    args.dtypes = args.dtypes.split(",")
    for name in args.ops:
        if name not in OPS:
            p.error(f"unknown op {name!r}; known: {', '.join(OPS)}")
    for name in args.dtypes:
        if name not in DTYPES:
            p.error(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}")
    if any(w < 2 for w in args.worlds):
        p.error("world sizes must be at least 2")
    if args.hosts is None and (args.link_gbit or args.flow_gbit or args.interleave):
        p.error("--link-gbit, --flow-gbit and --interleave go with --hosts")
    args.nsocks = [[n, n] for n in args.nsocks.split(",")] if args.nsocks else None
    if args.arena_slot_bytes:
        args.arena_slot_bytes = [[parse_size(v), v] for v in args.arena_slot_bytes.split(",")]
    if args.encrypt:
        args.encrypt = [[v == "1", v] for v in args.encrypt.split(",")]
        if any(v not in ("0", "1") for _, v in args.encrypt):
            p.error("--encrypt takes 0 and 1, e.g. 0,1")
    if sum(map(bool, (args.nsocks, args.arena_slot_bytes, args.encrypt))) > 1:
        p.error("--nsocks, --arena-slot-bytes and --encrypt each make series of their own: give one of them")
    if args.hosts is not None:
        if args.hosts < 2:
            p.error("--hosts must be at least 2")
        if any(w % args.hosts for w in args.worlds):
            p.error(f"every world size must be a multiple of --hosts {args.hosts}: {args.worlds}")
        if args.link_gbit is not None and args.link_gbit <= 0:
            p.error("--link-gbit must be positive")
        if args.flow_gbit is not None and args.flow_gbit <= 0:
            p.error("--flow-gbit must be positive")
    return args


def print_hosts_header(args: argparse.Namespace, hosts: Hosts, reference: dict):
    """What --hosts built, a measure of its link (into `reference`), and how to read link B/B."""
    h = args.hosts
    cap = f"capped at {args.link_gbit:g} Gbit/s each way (tc tbf)" if args.link_gbit else "not capped (veth)"
    if args.flow_gbit:
        cap += f", each TCP connection at {args.flow_gbit:g} Gbit/s (tc htb)"
    print(f"hosts: {h} network namespaces joined by a bridge, links {cap}; W/{h} ranks per host, "
          + ("rank r on host r % H" if args.interleave else "consecutive ranks on each host"))
    gbit = hosts.throughput_gbit(0, 1)
    reference["link_GBps"] = gbit / 8
    print(f"link: one TCP stream from host 0 to host 1 carries {gbit:.2f} Gbit/s ({gbit / 8:.3f} GB/s)")
    if args.flow_gbit:
        gbit4 = hosts.throughput_gbit(0, 1, streams=4)
        reference["link_4_streams_GBps"] = gbit4 / 8
        print(f"link: four TCP streams together carry {gbit4:.2f} Gbit/s")
    print(f"link B/B: bytes the busiest host sent over its link per payload byte in the checked call (headers "
          f"and ACKs included, the fencing Gloo barriers taken off); a hierarchical all_reduce sends "
          f"2(H-1)/H = {2 * (h - 1) / h:.2f}")


def main(argv=None) -> int:
    if "--latency" in (sys.argv[1:] if argv is None else argv):
        from rustc10d import bench_latency  # its own options; see there
        return bench_latency.main(argv)
    args = parse_args(argv)
    if args.worker:
        return worker_main(*args.worker)
    plan = [(name, dtype, size) for name in args.ops for dtype in OPS[name].dtypes if dtype in args.dtypes
            for size in sizes(args.min_size, args.max_size, args.step)]
    if not plan:
        print("nothing to run: no op has one of the dtypes asked for", file=sys.stderr)
        return 2
    cfg = {"plan": plan, "transports": args.transports, "rounds": args.rounds, "budget": args.budget, "warmup": args.warmup,
           "max_iters": args.max_iters, "pg_timeout": args.pg_timeout, "timeout": args.timeout}
    if args.hosts:
        cfg.update(hosts=args.hosts, link_gbit=args.link_gbit, flow_gbit=args.flow_gbit, interleave=args.interleave)
    if args.nsocks:
        cfg["vary"] = ("nsocks", "nsocks", args.nsocks)
    if args.arena_slot_bytes:
        cfg["vary"] = ("arena_slot_bytes", "arena", args.arena_slot_bytes)
    if args.encrypt:
        cfg["vary"] = ("encrypt", "encrypt", args.encrypt)
        if not (os.environ.get("RUSTC10D_SECRET") or os.environ.get("RUSTC10D_SECRET_FILE")):
            os.environ["RUSTC10D_SECRET"] = secrets.token_hex(32)  # every rank inherits it

    print(f"rustc10d {rustc10d.__version__} vs Gloo, torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"W={args.worlds}, {_size(args.min_size)}..{_size(args.max_size)}, {args.rounds} rounds of "
          f"~{args.budget} s per backend")
    reference = {"memcpy_1core_GBps": memcpy_bandwidth(64 << 20) / 1e9,
                 "tcp_loopback_GBps": tcp_loopback_bandwidth((128 if args.quick else 512) << 20) / 1e9}
    print(f"machine: memcpy of 64 MiB on one core {reference['memcpy_1core_GBps']:.2f} GB/s; "
          f"TCP over 127.0.0.1 between two processes {reference['tcp_loopback_GBps']:.2f} GB/s")

    def progress(e):
        cells = "  ".join(f"{b} {_time(res['time_s']['median']) if 'time_s' in res else ''}"
                          f"{'' if res['status'] == 'ok' else ' ' + res['status'].upper()}"
                          for b, res in summarize(e)["backends"].items())
        print(f"  W={e['world']} {e['op']} {e['dtype']} {_size(e['bytes'])}: {cells}", file=sys.stderr, flush=True)

    results, job_failures, idle = [], [], {}
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        hosts = None
        if args.hosts:
            try:
                hosts = stack.enter_context(Hosts(args.hosts, link_gbit=args.link_gbit, flow_gbit=args.flow_gbit))
            except TestbedUnavailable as e:
                print(f"--hosts: {e}", file=sys.stderr)
                return 2
            print_hosts_header(args, hosts, reference)
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="rustc10d-bench-"))
        for world in args.worlds:
            got, failure = run_world(world, cfg, Path(workdir), progress, hosts)
            idle.update({world: e["idle_cpu_fraction"] for e in got if "idle_cpu_fraction" in e})
            got = [e for e in got if "op" in e]
            results += got
            if failure:
                job_failures.append(failure)
            if len(got) < len(plan) and not failure:
                job_failures.append(f"W={world}: only {len(got)} of {len(plan)} results")
            print(f"\nW={world}: time and busbw are medians over rounds; ratio = gloo time / rustc10d time "
                  "in the same round (= rustc10d busbw / gloo busbw): > 1 means rustc10d is faster")
            for (w, name, dtype), entries in _groups(got).items():
                print_table(w, name, dtype, entries)
    print_summary(results, reference)
    for world, fraction in idle.items():
        print(f"idle: W={world}, every group connected, no op for {IDLE_SECONDS:g} s: the busiest rank "
              f"used {100 * fraction:.2f} % of a core")

    bad = failures(results)
    report = {"meta": {"rustc10d": rustc10d.__version__, "torch": torch.__version__, "cpus": os.cpu_count(),
                       "host": socket.gethostname(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "seconds": round(time.monotonic() - t0, 1), "argv": sys.argv[1:],
                       "config": {k: v for k, v in cfg.items() if k != "plan"}, "worlds": args.worlds},
              "reference": reference, "idle_cpu_fraction": idle, "ok": not bad and not job_failures,
              "failures": bad + job_failures, "results": results}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1))
    print(f"\nresults: {args.json}")
    if args.plot.lower() != "none":
        plot(report, Path(args.plot))
    print(f"took {report['meta']['seconds']} s")
    if report["failures"]:
        banner = "!" * 78
        print(f"\n{banner}\nBENCHMARK FAILED: {len(report['failures'])} problem(s)\n" + "\n".join(report["failures"])
              + f"\n{banner}", file=sys.stderr)
        return 1
    print("all results checked against arithmetic: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
