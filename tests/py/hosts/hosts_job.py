"""One rank of the multi-host jobs of tests/py/hosts/test_two_hosts.py: H "hosts" (network namespaces of
rustc10d.testbed), started by torchrun in each host or as plain processes (env://), in any
layout of ranks over hosts. RUSTC10D_TEST_HOST is the index of this rank's host.

    hosts_job.py           every collective against arithmetic, at sizes that divide by neither
                           the world nor the ranks per host; every rank ends with the same bits
    hosts_job.py init      init_process_group and a barrier only; prints how it went
    hosts_job.py striping  all_reduce of 16 MiB against arithmetic, 64 times and on until every
                           rank's connection counts are final (at most 90 s); prints the
                           connections this rank ends up sending on to each peer
                           (rustc10d.connections()) and the first and last calls' times

Prints `rank R on host H ok (N checks)` when everything held; a failed check raises (the process
exits non-zero with the check in its traceback)."""

import hashlib
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import rustc10d

HOST = int(os.environ["RUSTC10D_TEST_HOST"])
TIMEOUT = timedelta(seconds=30)
MIB = 1 << 20


def pattern(n: int, dtype: torch.dtype, offset: int) -> torch.Tensor:
    """(i % 13) + offset: small integers, so sums over ranks are exact even in bfloat16."""
    return (torch.arange(n) % 13 + offset).to(dtype)


def expect(what: str, got: torch.Tensor, want: torch.Tensor):
    if not torch.equal(got, want):
        bad = (got != want).nonzero().flatten()
        i = int(bad[0])
        raise AssertionError(f"rank {RANK}: {what}: {len(bad)} of {got.numel()} elements wrong, first at [{i}]: "
                             f"got {got[i].item()}, expected {want[i].item()}")


def say(line: str) -> None:
    """One line in one write: print() writes the text and its newline apart (unbuffered, as the
    tests run), so lines of ranks that share torchrun's output could run together."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def init_only() -> int:
    t0 = time.monotonic()
    try:
        dist.init_process_group("rustc10d", timeout=TIMEOUT)
        dist.barrier()
    except Exception as e:  # noqa: BLE001 - the failure is what the test looks at
        say(f"rank {os.environ.get('RANK')} on host {HOST}: init failed after {time.monotonic() - t0:.1f} s: "
            f"{type(e).__name__}: {e}")
        return 1
    say(f"rank {dist.get_rank()} on host {HOST}: init ok")
    dist.destroy_process_group()
    return 0


def striping() -> int:
    global RANK
    dist.init_process_group("rustc10d", timeout=TIMEOUT)
    RANK = rank = dist.get_rank()
    world = dist.get_world_size()
    n = 16 * MIB // 4
    want = sum(pattern(n, torch.float32, r + 1) for r in range(world))
    times = []
    # At least 64 all_reduces, then on until every rank's count is final (the counts seen while
    # it measures go back down to confirm a gain), within a bound.
    settled = torch.zeros(1)
    start = time.monotonic()
    while len(times) < 64 or (settled.item() < world and time.monotonic() - start < 90):
        t = pattern(n, torch.float32, rank + 1)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        times.append(time.perf_counter() - t0)
        expect("all_reduce of 16 MiB", t, want)
        settled.fill_(float(rustc10d._native.connections_settled(dist.group.WORLD.group_name)))
        dist.all_reduce(settled)
    say(f"rank {rank} on host {HOST}: connections {rustc10d.connections()} first {times[0]:.3f} s "
        f"last {min(times[-4:]):.3f} s settled {settled.item() == world} after {len(times)} all_reduces "
        f"in {time.monotonic() - start:.0f} s")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if sys.argv[1:] == ["init"]:
    sys.exit(init_only())
if sys.argv[1:] == ["striping"]:
    sys.exit(striping())

dist.init_process_group("rustc10d", timeout=TIMEOUT)
RANK, WORLD = dist.get_rank(), dist.get_world_size()
hosts_of: list = [None] * WORLD
dist.all_gather_object(hosts_of, HOST)
PER_HOST = hosts_of.count(HOST)
# roots on another host than rank 0's: the first rank of the next host, and the last rank
ROOTS = sorted({next(r for r, h in enumerate(hosts_of) if h != hosts_of[0]), WORLD - 1})
ODD = (1, 7, 100_003)  # element counts divisible by no world size and no ranks per host here
checks = 0

# all_reduce, SUM and AVG, float32 and bfloat16: 1, 30_001 and 300_003 elements, and 4 MiB
# (up to 30_001, one piece: on hosts of two or more ranks, the phases on a host run in its arena;
# larger ones go in pieces, in the arena on hosts of three or more)
for dtype in (torch.float32, torch.bfloat16):
    for n in (1, 30_001, 300_003, 4 * MIB // dtype.itemsize):
        total = sum(pattern(n, torch.float32, r + 1) for r in range(WORLD))
        for op, want in ((dist.ReduceOp.SUM, total), (dist.ReduceOp.AVG, total / WORLD)):
            t = pattern(n, dtype, RANK + 1)
            dist.all_reduce(t, op=op)
            expect(f"all_reduce {op} {dtype} x {n}", t, want.to(dtype))
            checks += 1

# reduce_scatter_tensor and the all-gathers: each rank's block is m elements
for dtype in (torch.float32, torch.bfloat16):
    for m in ODD:
        out = torch.empty(m, dtype=dtype)
        dist.reduce_scatter_tensor(out, pattern(m * WORLD, dtype, RANK + 1))
        total = sum(pattern(m * WORLD, torch.float32, r + 1) for r in range(WORLD))
        expect(f"reduce_scatter_tensor {dtype} x {m}", out, total[RANK * m:(RANK + 1) * m].to(dtype))
        everyone = torch.cat([pattern(m, dtype, 100 * r) for r in range(WORLD)])
        out = torch.empty(m * WORLD, dtype=dtype)
        dist.all_gather_into_tensor(out, pattern(m, dtype, 100 * RANK))
        expect(f"all_gather_into_tensor {dtype} x {m}", out, everyone)
        outs = [torch.empty(m, dtype=dtype) for _ in range(WORLD)]
        dist.all_gather(outs, pattern(m, dtype, 100 * RANK))
        expect(f"all_gather {dtype} x {m}", torch.cat(outs), everyone)
        checks += 3

# broadcast from, and reduce to, roots on another host than rank 0
for root in ROOTS:
    for n in ODD + (MIB + 1,):
        t = pattern(n, torch.float32, 7) if RANK == root else torch.full((n,), -1.0)
        dist.broadcast(t, src=root)
        expect(f"broadcast from {root} x {n}", t, pattern(n, torch.float32, 7))
        t = pattern(n, torch.float32, RANK + 1)
        dist.reduce(t, dst=root)
        if RANK == root:
            expect(f"reduce to {root} x {n}", t, sum(pattern(n, torch.float32, r + 1) for r in range(WORLD)))
        checks += 2

# every rank ends with the same bits from an all_reduce of random data (rounding depends on order)
for dtype in (torch.float32, torch.bfloat16):
    for n in (300_003, 4 * MIB // dtype.itemsize):
        inputs = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * r + n)).to(dtype)
                  for r in range(WORLD)]
        t = inputs[RANK].clone()
        dist.all_reduce(t)
        close = torch.allclose(t.float(), sum(x.float() for x in inputs), rtol=0.02, atol=0.05 * WORLD)
        assert close, f"rank {RANK}: all_reduce of random {dtype} x {n} is far from the sum"
        digests: list = [None] * WORLD
        dist.all_gather_object(digests, hashlib.sha256(t.view(torch.uint8).numpy()).hexdigest())
        assert len(set(digests)) == 1, f"all_reduce {dtype} x {n}: ranks differ in bits: {digests}"
        checks += 1

# all_to_all_single: rank r's block for rank p holds 1000 r + p (it exchanges with every rank,
# so all peers are connected for the look at the links below)
out = torch.empty(WORLD, dtype=torch.int64)
dist.all_to_all_single(out, torch.arange(WORLD, dtype=torch.int64) + 1000 * RANK)
expect("all_to_all_single", out, torch.arange(WORLD, dtype=torch.int64) * 1000 + RANK)
checks += 1

# shared memory with the ranks of this host, TCP to every other
links = rustc10d.links()
want = {p: "shm" if hosts_of[p] == HOST else "tcp" for p in range(WORLD) if p != RANK}
assert links == want, f"rank {RANK} on host {HOST} (hosts of ranks: {hosts_of}): links {links}, expected {want}"
dist.barrier()  # no rank leaves (closing its links) before every rank has looked

say(f"rank {RANK} on host {HOST} ok ({checks} checks, {PER_HOST} ranks on this host)")
dist.destroy_process_group()
