"""A preflight check of a cluster for rustc10d: run it as the training job will run, e.g.::

    torchrun --nnodes 2 --nproc-per-node 8 ... -m rustc10d.check [--timeout 20] [--mib 8] [--min-gbit G]

Every rank reports what its node has (torch, this build, the file-descriptor limit, shared
memory, whether peers on its host may read its memory: single copy), then every pair of ranks
measures its link once, both directions (latency: a ping-pong of 4 bytes; bandwidth: --mib MiB
in 4 messages, best of 3), pairs in rounds of disjoint pairs. Rank 0 prints one table of nodes and one of
links; a link is flagged SLOW at under half the median bandwidth of the links of its kind (or
under --min-gbit), ASYMMETRIC when one direction is under half the other. A peer that cannot be
reached is named, with the error, within the timeout: this never hangs. The reports travel
through torchrun's Store, not the group, so a broken link still leaves a report.

Exit status (rank 0): 1 where a link failed or a rank sent no report, else 0 (flagged links are
warnings).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import rustc10d

LATENCY_ROUNDS = 20
BANDWIDTH_MESSAGES = 4
BANDWIDTH_TRIES = 3


def _yama_scope() -> int | None:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def single_copy() -> str:
    """Whether peers on this host may read this process's memory, and why (what rustc10d's
    rendezvous will find, unless a container's seccomp filter forbids process_vm_readv)."""
    if os.environ.get("RUSTC10D_SINGLE_COPY_BYTES", "").strip() == "0":
        return "off (RUSTC10D_SINGLE_COPY_BYTES=0)"
    scope = _yama_scope()
    ptracer_any = os.environ.get("RUSTC10D_PTRACER_ANY", "1").strip().lower() not in ("0", "false", "off", "no")
    if scope is None:
        return "yes (no Yama)"
    if scope == 0:
        return "yes (ptrace_scope 0)"
    if scope == 1:
        return ("yes (ptrace_scope 1: rustc10d opens each process to its peers)" if ptracer_any
                else "no (ptrace_scope 1 and RUSTC10D_PTRACER_ANY=0)")
    return f"no (ptrace_scope {scope}: needs CAP_SYS_PTRACE)" if scope == 2 else f"no (ptrace_scope {scope})"


def _local_address() -> str:
    """The address this process reaches the Store's host from: tells apart hosts that share a
    hostname (containers, network namespaces)."""
    target = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return "?"


def node_facts() -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        shm = os.statvfs("/dev/shm")
        shm_total, shm_free = shm.f_blocks * shm.f_frsize, shm.f_bavail * shm.f_frsize
    except OSError:
        shm_total = shm_free = 0
    return {
        "host": socket.gethostname(),
        "address": _local_address(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "rustc10d": f"{rustc10d.__version__} (for torch {rustc10d.BUILT_FOR_TORCH})",
        "fd_limit": f"{soft}/{hard}",
        "shm": f"{shm_free / 2**30:.1f}/{shm_total / 2**30:.1f} GiB",
        "single_copy": single_copy(),
        "transport": os.environ.get("RUSTC10D_TRANSPORT", "auto"),
        "ifname": os.environ.get("RUSTC10D_SOCKET_IFNAME", ""),
    }


def rounds(world: int) -> list[list[tuple[int, int]]]:
    """Every pair of ranks once, in world-1 rounds (world rounds when odd) of disjoint pairs:
    the circle method, a bye for the odd one out."""
    n = world + world % 2
    ring = list(range(n))
    out = []
    for _ in range(n - 1):
        pairs = [(min(ring[i], ring[n - 1 - i]), max(ring[i], ring[n - 1 - i])) for i in range(n // 2)]
        out.append([p for p in pairs if p[1] < world])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return out


def _ping_pong(peer: int, first: bool) -> float:
    """Half the round trip of 4 bytes, in seconds (median of LATENCY_ROUNDS after a warm-up)."""
    t = torch.zeros(1)
    times = []
    for i in range(LATENCY_ROUNDS + 3):
        t0 = time.perf_counter()
        if first:
            dist.send(t, peer)
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            dist.send(t, peer)
        if i >= 3:
            times.append((time.perf_counter() - t0) / 2)
    return statistics.median(times)


def _stream(peer: int, sending: bool, nbytes: int) -> float | None:
    """Bytes per second of `nbytes` in BANDWIDTH_MESSAGES messages, on the sender (until the
    receiver's ack), the best of BANDWIDTH_TRIES (what the link can do, not what a busy moment
    let it); None on the receiver."""
    block = torch.empty(max(1, nbytes // BANDWIDTH_MESSAGES // 4))
    sink = torch.empty_like(block)
    ack = torch.zeros(1)
    best = 0.0
    for _ in range(BANDWIDTH_TRIES):
        if sending:
            t0 = time.perf_counter()
            for w in [dist.isend(block, peer) for _ in range(BANDWIDTH_MESSAGES)]:
                w.wait()
            dist.recv(ack, peer)
            best = max(best, block.numel() * 4 * BANDWIDTH_MESSAGES / (time.perf_counter() - t0))
        else:
            for w in [dist.irecv(sink, peer) for _ in range(BANDWIDTH_MESSAGES)]:
                w.wait()
            dist.send(ack, peer)
    return best if sending else None


def measure(rank: int, world: int, nbytes: int, store: dist.Store, stopped: str) -> dict:
    """This rank's halves of the links it measured: {peer: {...}}. The first failure anywhere
    stops every rank at its next round (the Store key `stopped` says whose), so that no rank
    waits in turn for a partner that gave up."""
    links: dict[int, dict] = {}
    error = None
    for pairs in rounds(world):
        pair = next((p for p in pairs if rank in p), None)
        if pair is None:
            continue
        peer = pair[1] if pair[0] == rank else pair[0]
        first = rank == pair[0]
        if error is None and store.check([stopped]):
            error = f"the check stopped after {store.get(stopped).decode()}"
        if error is not None:
            links[peer] = {"error": f"not measured: {error}"}
            continue
        try:
            # The warm-up opens the connection (rustc10d connects on first use).
            dist.send(torch.zeros(1), peer) if first else dist.recv(torch.zeros(1), peer)
            latency = _ping_pong(peer, first)
            out = _stream(peer, first, nbytes)
            back = _stream(peer, not first, nbytes)
            links[peer] = {"latency_s": latency, "send_Bps": out if first else back}
        except Exception as e:  # noqa: BLE001 - any failure is the answer, and ends the group
            error = _said(e)
            links[peer] = {"error": error}
            store.set(stopped, f"rank {rank} failed with rank {peer}")
            error = f"this rank failed with rank {peer}"
    kinds = rustc10d.links() if error is None else {}
    for peer, link in links.items():
        link["kind"] = kinds.get(peer, "?")
    return {"links": {str(p): v for p, v in links.items()}}


def _said(e: BaseException) -> str:
    """An exception in one line: torch's C++ errors carry their stack after the first."""
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"


def _fmt_rate(bps: float) -> str:
    return f"{bps * 8 / 1e9:.2f} Gbit/s"


def report(facts: list[dict | None], results: list[dict | None], min_gbit: float | None) -> int:
    world = len(facts)
    status = 0
    nodes: dict[tuple[str, str], list[int]] = {}
    for r, f in enumerate(facts):
        if f is not None:
            nodes.setdefault((f["host"], f["address"]), []).append(r)
    print(f"rustc10d preflight: {world} ranks on {len(nodes)} node(s)")
    cols = ["host", "address", "torch", "rustc10d", "python", "fd_limit", "shm", "single_copy", "transport"]
    print("| ranks | " + " | ".join(c.replace("_", " ") for c in cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for ranks in nodes.values():
        f = facts[ranks[0]]
        print(f"| {','.join(map(str, ranks))} | " + " | ".join(str(f[c]) for c in cols) + " |")
    silent = [r for r in range(world) if facts[r] is None or results[r] is None]
    if silent:
        status = 1
        print(f"NO REPORT from rank(s) {silent} within the timeout: they did not start, or hung")

    rows = []
    for a in range(world):
        for b in range(world):
            if a == b or results[a] is None:
                continue
            link = results[a]["links"].get(str(b))
            if link is None:
                continue
            rows.append((a, b, link))
    by_kind: dict[str, list[float]] = {}
    for _, _, link in rows:
        if "send_Bps" in link:
            by_kind.setdefault(link["kind"], []).append(link["send_Bps"])
    medians = {k: statistics.median(v) for k, v in by_kind.items()}
    flagged = False
    print()
    print("| from | to | link | latency | bandwidth | flags |")
    print("|---|---|---|---|---|---|")
    for a, b, link in rows:
        if "error" in link:
            status = 1
            print(f"| {a} | {b} | {link['kind']} | - | - | FAILED: {link['error']} |")
            continue
        flags = []
        rate = link["send_Bps"]
        if rate < medians[link["kind"]] / 2 or (min_gbit is not None and rate * 8 / 1e9 < min_gbit):
            flags.append("SLOW")
        back = results[b]["links"].get(str(a), {}) if results[b] is not None else {}
        if "send_Bps" in back and rate < back["send_Bps"] / 2:
            flags.append("ASYMMETRIC")
        flagged = flagged or bool(flags)
        print(f"| {a} | {b} | {link['kind']} | {link['latency_s'] * 1e6:.0f} µs | {_fmt_rate(rate)} | "
              f"{' '.join(flags)} |")
    print()
    print("FAILED: see above" if status else "links flagged: see above" if flagged else "all links measured, none flagged")
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rustc10d.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds any one step may take (20)")
    parser.add_argument("--mib", type=float, default=8.0, help="MiB of each bandwidth try, each direction (8)")
    parser.add_argument("--min-gbit", type=float, default=None, help="flag links slower than this")
    args = parser.parse_args(argv)
    timeout = timedelta(seconds=args.timeout)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # Under torchrun its agent serves the Store; plain processes (env://) have rank 0 serve it.
    serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=serve,
                          timeout=timeout, wait_for_workers=False)
    prefix = f"rustc10d-check/{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}"
    store.set(f"{prefix}/facts/{rank}", json.dumps(node_facts()))
    try:
        dist.init_process_group("rustc10d", store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                                timeout=timeout)
        result = measure(rank, world, int(args.mib * 2**20), store, f"{prefix}/stopped")
    except Exception as e:  # noqa: BLE001 - reported, not raised
        result = {"links": {}, "error": _said(e)}
    store.set(f"{prefix}/result/{rank}", json.dumps(result))
    if rank != 0:
        # Rank 0 reads the reports; leaving before it did would end the Store under it.
        try:
            store.wait([f"{prefix}/done"], timedelta(seconds=args.timeout * 4))
        except Exception:  # noqa: BLE001 - rank 0 gone: nothing more to do
            pass
        _close()
        return 0
    # The others are done about when this rank is (a failure stops them all): a report that has
    # not come a timeout later will not come.
    deadline = time.monotonic() + args.timeout

    def read(key: str) -> dict | None:
        try:
            store.wait([key], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            return json.loads(store.get(key))
        except Exception:  # noqa: BLE001 - no report within the deadline
            return None

    facts = [read(f"{prefix}/facts/{r}") for r in range(world)]
    results = [read(f"{prefix}/result/{r}") for r in range(world)]
    for r, res in enumerate(results):
        if res is not None and "error" in res:
            print(f"rank {r} could not take part: {res['error']}")
    status = report(facts, results, args.min_gbit)
    store.set(f"{prefix}/done", "1")
    _close()
    return status


def _close() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group still goes
            pass


if __name__ == "__main__":
    sys.exit(main())
