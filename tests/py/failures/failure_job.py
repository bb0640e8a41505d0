"""One rank of a failure scenario (tests/py/failures/test_failures.py). Each scenario makes something go
wrong and prints `RESULT <json>` with what this rank saw: how long the failing op took to
raise and its message. Ranks that are supposed to die just die."""

import argparse
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import job_args
import own_threads
import rustc10d


def report(**fields):
    sys.stdout.write("RESULT " + json.dumps(fields) + "\n")
    sys.stdout.flush()


def timed_failure(fn) -> dict:
    """Run fn, which must raise; how long it took and what it said."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - any exception is what we measure
        return {"raised": True, "seconds": time.monotonic() - t0, "error": f"{type(e).__name__}: {e}"}
    return {"raised": False, "seconds": time.monotonic() - t0, "error": ""}


def rustc10d_threads() -> int:
    return sum(n.startswith("rustc10d") for n in own_threads.names_after_joins())


def sockets() -> int:
    def target(fd):
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the fd of the listing itself, gone by now
            return ""
    return sum(target(fd).startswith("socket:") for fd in os.listdir("/proc/self/fd"))


def shm_maps() -> int:
    """Shared-memory segments this process still maps (they are memfds: /memfd:rustc10d)."""
    with open("/proc/self/maps") as f:
        return sum("memfd:rustc10d" in line for line in f)


def init(store, rank, world, seconds=30, options=None):
    dist.init_process_group("rustc10d", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=seconds), pg_options=options)


def sigkill(store, rank, world, numel=1 << 20):
    """The last rank dies (SIGKILL) while everyone is in an all_reduce."""
    init(store, rank, world)
    t = torch.ones(numel)
    dist.all_reduce(t)
    if rank == world - 1:
        time.sleep(0.3)  # let the others block in the next all_reduce
        os.kill(os.getpid(), signal.SIGKILL)
    first = timed_failure(lambda: dist.all_reduce(t))
    later = timed_failure(lambda: dist.all_reduce(t))
    report(first=first, later=later)


def sigkill_small(store, rank, world):
    """The same with a small all_reduce: on one host, everyone waits in the shared arena."""
    sigkill(store, rank, world, numel=1000)


def staged_killed(store, rank, world):
    """Under test staging in pieces (set by the test), the last rank dies (SIGKILL) 0.1 s
    into a 512 MiB all_reduce, after some pieces have gone through: the others' tensor stays
    bit-for-bit as it was. (At 128 MiB, since the 1 MiB pieces run in the arena, the op could
    end within 0.1 s, and the kill came too late.)"""
    init(store, rank, world)
    dist.all_reduce(torch.ones(8))  # every rank connected
    t = torch.arange(1 << 27, dtype=torch.float32) + rank
    before = t.clone()
    if rank == world - 1:
        threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    res = timed_failure(lambda: dist.all_reduce(t))
    report(first=res, untouched=bool(torch.equal(t, before)))


def staged_recv_killed(store, rank, world):
    """Under test staging (stream order, as RUSTC10D_CUDA_WAIT=stream on a GPU), rank 1 dies
    (SIGKILL) 0.1 s into a 512 MiB send to rank 0: the part of it that arrived is in rank 0's
    host copy, and none of it may reach the tensor. The group is broken for p2p with rank 1,
    not the stream: an op issued after the failed receive still lands."""
    init(store, rank, world)
    dist.all_reduce(torch.ones(8))  # every rank connected
    t = torch.arange(1 << 27, dtype=torch.float32) + rank
    before = t.clone()
    if rank == 1:
        threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        dist.send(t, dst=0)
        time.sleep(10)
    work = dist.irecv(t, src=1)
    res = timed_failure(work.wait)
    after = torch.zeros(4)
    later = timed_failure(lambda: dist.irecv(after, src=1).wait())  # its peer is gone: it fails too
    report(first=res, untouched=bool(torch.equal(t, before)), later_raised=later["raised"],
           later_untouched=bool(torch.equal(after, torch.zeros(4))))


def staged_dropped_recv_expires(store, rank, world):
    """Under test staging (stream order), rank 0 posts a receive nobody sends and drops its
    Work; the group's timeout is 3 s. An all_reduce issued after it is ordered after it: it
    lands once the gates have ended the receive at its timeout (not never), with its right sum."""
    init(store, rank, world, seconds=3)
    dist.all_reduce(torch.ones(8))  # every rank connected
    if rank == 0:
        dist.irecv(torch.zeros(4), src=1, tag=77)
    t = torch.ones(1000)
    t0 = time.monotonic()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    report(seconds=time.monotonic() - t0, sum=float(t[0]), completed=work.is_completed())
    if rank == 1:
        time.sleep(12)  # alive well past rank 0's timeout: its receive ends by expiring, not by a lost peer


def staged_destroy_with_recv_pending(store, rank, world):
    """Under test staging (stream order), rank 0 destroys its group with a receive nobody sends
    still posted (the group's timeout is 60 s): the destroy ends the receive (the transport's
    shutdown fails it; the gates would end it otherwise), which raises and leaves its tensor as
    it was, and nothing waits for its ticket: the destroy returns within seconds."""
    init(store, rank, world, seconds=60)
    dist.all_reduce(torch.ones(8))  # every rank connected
    t = torch.full((1000,), 5.0)
    work = dist.irecv(t, src=1, tag=78) if rank == 0 else None
    dist.barrier()
    if rank == 1:
        time.sleep(3)  # rank 0's destroy, not rank 1's leaving, ends the receive
    t0 = time.monotonic()
    dist.destroy_process_group()
    took = time.monotonic() - t0
    if work is None:
        return report(destroy_seconds=took)
    report(destroy_seconds=took, completed=work.is_completed(), success=work.is_success(),
           wait=timed_failure(work.wait), untouched=bool(torch.equal(t, torch.full((1000,), 5.0))))


def injected(store, rank, world):
    """RUSTC10D_FAULT (set by the test) makes rank 1's third all_reduce fail."""
    init(store, rank, world)
    t = torch.ones(100)
    dist.all_reduce(t)
    dist.all_reduce(t)
    report(first=timed_failure(lambda: dist.all_reduce(t)))


def dropped(store, rank, world):
    """RUSTC10D_FAULT cuts rank 0's connections as its second all_reduce starts."""
    init(store, rank, world)
    t = torch.ones(100)
    dist.all_reduce(t)
    report(first=timed_failure(lambda: dist.all_reduce(t)))


def recv_times_out(store, rank, world):
    """A receive whose sender never sends, with the group's 2 s timeout."""
    init(store, rank, world, seconds=2)
    if rank == 0:
        report(first=timed_failure(lambda: dist.recv(torch.zeros(3), src=1, tag=5)))
    else:
        time.sleep(3)
        report(first={"raised": True, "seconds": 0, "error": ""})


def error_type() -> str | None:
    """What the default group's backend says broke it (torch's getError), where torch's Python
    asks (2.11 binds get_error only on its own wrapper and NCCL backends)."""
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    return backend.get_error().name if hasattr(backend, "get_error") else None


def stall_times_out(store, rank, world):
    """RUSTC10D_FAULT stalls rank 0's broadcast past the group's 2 s timeout."""
    init(store, rank, world, seconds=2)
    t = torch.ones(100)
    report(first=timed_failure(lambda: dist.broadcast(t, 0)), error_type=error_type())


def abort_hooks(store, rank, world):
    """torch 2.15's abort hooks and getError: two hooks registered (one raises), one
    registered and taken back. Every rank's receive times out (no sender): the group stays
    usable and getError says so; then the last rank dies mid-all_reduce: the others'
    all_reduce raises and getError says a peer broke the group; the hooks have not run (they
    run at an abort); then the group is aborted: they run. Meanwhile torch's flight recorder
    recorded each op, completed with its duration where it succeeded."""
    init(store, rank, world, seconds=2)
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    calls = []

    def bad_hook():
        raise RuntimeError("a hook that fails")

    backend.register_abort_hook(1, lambda: calls.append(1))
    backend.register_abort_hook(2, lambda: calls.append(2))
    backend.register_abort_hook(3, bad_hook)
    backend.unregister_abort_hook(2)
    out = {"before": backend.get_error().name}
    out["p2p"] = timed_failure(lambda: dist.recv(torch.zeros(3), src=(rank + 1) % world, tag=9))
    out["after_p2p"], out["calls_p2p"] = backend.get_error().name, list(calls)
    dist.barrier()
    dist.all_reduce(torch.ones(10))
    if rank == world - 1:
        time.sleep(0.3)  # let the others block in the all_reduce
        os.kill(os.getpid(), signal.SIGKILL)
    out["collective"] = timed_failure(lambda: dist.all_reduce(torch.ones(10)))
    out["after_collective"], out["calls_collective"] = backend.get_error().name, list(calls)
    # torch's flight recorder (2.15: any backend, through the completion hooks): what it holds.
    trace = json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False, backend="rustc10d"))
    out["flight_recorder"] = [[e["profiling_name"], e["state"], e.get("duration_ms")] for e in trace.get("entries", [])]
    dist.distributed_c10d._abort_process_group()
    out["calls_abort"] = list(calls)
    report(**out)


def mismatch(store, rank, world):
    """Rank 1 reduces int32 where the others reduce float32 (the same bytes)."""
    init(store, rank, world)
    # Every rank is past init first: the mismatch breaks the group at once, and a rank still
    # connecting would raise in init_process_group instead (correctly, but not what is measured).
    dist.barrier()
    t = torch.ones(64, dtype=torch.int32 if rank == 1 else torch.float32)
    before = t.clone()
    res = timed_failure(lambda: dist.all_reduce(t))
    report(first=res, untouched=bool(torch.equal(t, before)))


def world_failure_spares_groups(store, rank, world):
    """A mismatch on the default group breaks the default group alone: it stays broken
    (collectives and sends refuse), while a group made before it on its connections goes on,
    and groups made after it work too, on its connections or on connections of their own."""
    init(store, rank, world)
    dist.barrier()
    sibling = dist.new_group()
    dist.all_reduce(torch.ones(4), group=sibling)
    t = torch.ones(64, dtype=torch.int32 if rank == 1 else torch.float32)
    first = timed_failure(lambda: dist.all_reduce(t))
    again = timed_failure(lambda: dist.all_reduce(torch.ones(1)))
    send = timed_failure(lambda: dist.send(torch.ones(1), dst=(rank + 1) % world))
    on_sibling = torch.full((100_000,), float(rank))
    dist.all_reduce(on_sibling, group=sibling)
    later = dist.new_group()
    on_later = torch.ones(3)
    dist.all_reduce(on_later, group=later)
    own = dist.new_group(pg_options=rustc10d.Options(share_connections=False))
    on_own = torch.ones(2)
    dist.all_reduce(on_own, group=own)
    report(first=first, again=again, send=send, sibling_sum=on_sibling[-1].item(), later_sum=on_later[0].item(),
           own_sum=on_own[0].item())


def late_mismatch(store, rank, world):
    """The last rank, late, all_reduces one element more than the others, on the ring (too
    large for the direct exchange): the ranks whose neighbours called as they did must not start
    either, or they would fold each other's data into their tensors before the group breaks."""
    init(store, rank, world)
    dist.barrier()
    t = torch.arange(100_000 + (rank == world - 1), dtype=torch.float32) + rank
    before = t.clone()
    if rank == world - 1:
        time.sleep(0.5)
    res = timed_failure(lambda: dist.all_reduce(t))
    report(first=res, untouched=bool(torch.equal(t, before)))


def destroy_cleans_up(store, rank, world):
    """destroy_process_group() leaves no engine thread or socket behind, and a waiter on a
    receive that will never come is released by it."""
    counts = []
    for cycle in range(2):
        init(store, rank, world)
        t = torch.ones(10)
        dist.all_reduce(t)
        mapped = shm_maps()
        waited = {}
        if rank == 0:
            work = dist.irecv(torch.zeros(1), src=1, tag=77)  # nobody sends this
            waiter = threading.Thread(target=lambda: waited.update(timed_failure(work.wait)))
            waiter.start()
            time.sleep(0.3)
        dist.barrier()
        t0 = time.monotonic()
        dist.destroy_process_group()
        destroy_seconds = time.monotonic() - t0
        if rank == 0:
            waiter.join(10)
        counts.append({"threads": rustc10d_threads(), "sockets": sockets(), "destroy_seconds": destroy_seconds,
                       "waiter": waited, "mapped_during": mapped, "mapped_after": shm_maps()})
    report(cycles=counts)


def settings_differ(store, rank, world):
    """Rank 1 asks for other segments than the others (settings every rank must share)."""
    options = rustc10d.Options(segment_bytes=65536) if rank == 1 else None
    report(first=timed_failure(lambda: init(store, rank, world, options=options)))


def settings_differ_store_in_rank_0(store, rank, world):
    """settings_differ with the Store in rank 0's process, as env:// puts it: rank 0 exits
    as soon as its init has failed, and rank 2 comes a second late."""
    if rank == 0:
        own = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=30))
        store.set("rank 0's store", str(own.port))
        while store.add("connected to rank 0's store", 0) < world - 1:
            time.sleep(0.01)
    else:
        own = dist.TCPStore("127.0.0.1", int(store.get("rank 0's store")), world, is_master=False,
                            timeout=timedelta(seconds=30))
        store.add("connected to rank 0's store", 1)
    if rank == 2:
        time.sleep(1)
    options = rustc10d.Options(segment_bytes=65536) if rank == 1 else None
    report(first=timed_failure(lambda: init(own, rank, world, options=options)))


def bad_setting(store, rank, world):
    """Rank 1 asks for an impossible setting: it fails, and tells the others so at once."""
    options = rustc10d.Options(nsocks=0) if rank == 1 else rustc10d.Options(nsocks=2)
    report(first=timed_failure(lambda: init(store, rank, world, options=options)))


def no_threads(store, rank, world):
    """Rank 1 cannot start a thread (as when a container's pids limit is reached): Rust's
    threads ask for a stack larger than the address space, so creating one fails with EAGAIN.
    It must raise, not panic, and tell the others at once."""
    if rank == 1:
        os.environ["RUST_MIN_STACK"] = str(1 << 50)  # read at this process's first Rust thread
    report(first=timed_failure(lambda: init(store, rank, world, seconds=30)))


def error_kinds(store, rank, world):
    """Each kind of failure reaches Python as the exception torch's own backends raise."""
    init(store, rank, world, seconds=2)
    kinds = {
        "bad input": timed_failure(lambda: dist.broadcast(torch.ones(2), src=world + 5)),
        "unsupported": timed_failure(lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)),
        "timeout": timed_failure(lambda: dist.recv(torch.zeros(1), src=1 - rank, tag=123)),
    }
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    kinds["peer lost"] = timed_failure(lambda: dist.recv(torch.zeros(1), src=1, tag=124))
    report(**kinds)


def options_apply(store, rank, world):
    """rustc10d.Options given to init_process_group and to new_group set each group's
    settings (here the transport: TCP for the world, shared memory for a subgroup, which also
    asks for stream-ordered CUDA waits: CPU tensors are unaffected); anything but
    rustc10d.Options is refused."""
    init(store, rank, world, options=rustc10d.Options(transport="tcp", spin_us=0))
    t = torch.ones(4)
    dist.all_reduce(t)
    group = dist.new_group(list(range(world)), pg_options=rustc10d.Options(transport="shm", cuda_wait="stream"))
    dist.all_reduce(t, group=group)
    wrong = timed_failure(lambda: dist.new_group(list(range(world)), pg_options=object()))
    report(world_links=rustc10d.links(), group_links=rustc10d.links(group), sum=t.tolist(), wrong=wrong)


SCENARIOS = {f.__name__: f for f in (sigkill, sigkill_small, staged_killed, staged_recv_killed,
                                      staged_dropped_recv_expires, staged_destroy_with_recv_pending, injected, dropped, recv_times_out, stall_times_out, mismatch, world_failure_spares_groups, late_mismatch,
                                      destroy_cleans_up, settings_differ, settings_differ_store_in_rank_0, bad_setting, no_threads, error_kinds,
                                      options_apply, abort_hooks)}

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=SCENARIOS)
    a, store = job_args.parse(p)
    SCENARIOS[a.scenario](store, a.rank, a.world)
    os._exit(0)  # skip interpreter teardown of a possibly broken group
