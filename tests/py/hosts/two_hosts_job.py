"""One rank of the two-host jobs (tests/py/hosts/test_two_hosts.py): 2 or 3 "hosts" (network namespaces)
with 2 ranks each. Ranks on different hosts can only reach each other if every rank
advertised an address of its own host, not loopback. With `partition`, after the checks every
rank keeps all-reducing until the test cuts the link, and reports how long the failure took.
With `kill` (plain processes, any layout), every rank keeps all-reducing at once, and rank 1
kills itself (SIGKILL) after 50 of them; the others report how long their failure took."""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import rustc10d

PARTITION = "partition" in sys.argv[1:]
KILL = "kill" in sys.argv[1:]
dist.init_process_group("rustc10d", timeout=timedelta(seconds=5 if PARTITION else 30))
rank, world = dist.get_rank(), dist.get_world_size()


def all_reduce_until_it_fails(victim: int | None = None):
    """Small all_reduces (one piece: on a host of two ranks, in its arena) until one raises;
    says after how long, and exits. Rank `victim` kills itself after 50."""
    sys.stdout.flush()
    t = torch.ones(1000)
    last_ok = time.monotonic()
    done = 0
    try:
        while time.monotonic() - last_ok < 60:
            if rank == victim and done == 50:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(t)
            last_ok = time.monotonic()
            done += 1
    except Exception as e:  # noqa: BLE001 - the failure is what we measure
        sys.stdout.write(f"rank {rank} raised after {time.monotonic() - last_ok:.1f} s: {e}\n")
        sys.stdout.flush()
        os._exit(0)
    sys.stdout.write(f"rank {rank} never raised\n")
    os._exit(1)


if KILL:
    all_reduce_until_it_fails(victim=1)

t = torch.full((100_003,), float(rank))
dist.all_reduce(t)
assert torch.all(t == sum(range(world))), t

# point to point with the rank half the world away (on another host)
peer = (rank + world // 2) % world
got = torch.zeros(5)
if rank < peer:
    dist.send(torch.full((5,), float(rank)), peer)
    dist.recv(got, peer)
else:
    dist.recv(got, peer)
    dist.send(torch.full((5,), float(rank)), peer)
assert torch.all(got == peer), got

# a DDP step: every rank must end with the same parameters
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(rank)
model(torch.randn(16, 8)).square().mean().backward()
opt.step()
flat = torch.cat([p.detach().flatten() for p in model.parameters()])
everyone = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(everyone, flat)
assert all(torch.equal(everyone[0], x) for x in everyone), "DDP replicas diverged"

# shared memory with the rank on this host, TCP to other hosts (torchrun: node 0 has ranks 0, 1)
links = rustc10d.links()
want = {p: "shm" if p // 2 == rank // 2 else "tcp" for p in links}
assert links == want and "shm" in links.values() and "tcp" in links.values(), links
dist.barrier()  # no rank leaves (closing its links) before every rank has looked

sys.stdout.write(f"rank {rank} on {os.environ.get('RUSTC10D_TEST_HOST')} ok\n")
if PARTITION:
    all_reduce_until_it_fails()
dist.destroy_process_group()
