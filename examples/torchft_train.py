"""Fault-tolerant training with torchft on rustc10d: replica groups as processes, a real
Lighthouse, DDP through torchft's Manager on a native rustc10d group, one replica killed and
started again.

    pip install torchft-nightly    # torch 2.14 on (the native reconfigure API)
    python examples/torchft_train.py [--replicas 3] [--steps 40] [--grad-mib 8] [--kill-at 20]
                                     [--backend rustc10d|gloo|torchft-gloo]
                                     [--algorithm ddp|localsgd|diloco] [--sync-every 4]

The launcher (this script without --replica) starts torchft's Lighthouse, hosts the TCPStore the
replicas' native groups meet through, and starts one process per replica group. Each replica
trains a model of `--grad-mib` MiB of float32 parameters, with torchft's DistributedDataParallel
and OptimizerWrapper (every step's gradients averaged across replicas), LocalSGD (the parameters,
every `--sync-every` steps) or DiLoCo (the pseudo-gradients, every `--sync-every` steps, through an
outer optimizer), all through `Manager.allreduce` over the cross-replica group:
`rustc10d.reconfigurable_group`, or, to compare, Gloo's native group with enable_reconfigure, or
torchft's own ProcessGroupGloo. A step below is one of the Manager's: each DDP step, each sync.

At step `--kill-at` the launcher SIGKILLs the last replica and starts it again at once. The
survivors' all_reduce in flight fails and torchft skips that step (or, killed between steps, the
replica is left out of the next quorum); the Lighthouse forms a quorum of the survivors and the
Manager reconfigures the group to it; the new process joins a later quorum and heals from a
survivor's checkpoint. Every replica trains until step `--steps` in a quorum of all replicas,
then saves its parameters; the launcher prints "OK" when all are equal, each replica's median
step time over the steps all replicas took part in (before the kill, after warm-up), and what the
recovery took: when the survivors' step failed, how long the group's reconfigure and its first
all_reduce after it took (the backend's part), when they trained on, and when the restarted
replica did.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

WARMUP = 3  # steps left out of the step time: the first quorum, lazy allocations


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make_model(grad_mib: int) -> nn.Module:
    """Layers of 512 x 512 float32 weights, 1 MiB each: `grad_mib` MiB of gradients a step."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(512, 512, bias=False) for _ in range(grad_mib)))


def native_group(backend: str, store_port: int, timeout: timedelta, replica: int, replicas: int):
    """The cross-replica group of this replica's group rank 0, as the Manager takes it."""
    # A client of the launcher's store, so that every replica, a restarted one too, meets the
    # others' reconfigure under one prefix.
    store = dist.PrefixStore("torchft/group_rank_0",
                             dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout))
    if backend == "rustc10d":
        import rustc10d
        return rustc10d.reconfigurable_group(store, timeout=timeout)
    if backend == "gloo":
        # Gloo's reconfigure handle is the rank it was made with: each replica needs its own.
        pg = dist.ProcessGroup(store, replica, replicas)
        gloo = dist.ProcessGroupGloo(store, replica, replicas, timeout, enable_reconfigure=True)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
        return pg
    from torchft.process_group import ProcessGroupGloo  # what torchft users run today
    return ProcessGroupGloo(timeout=timeout)


class ReconfigureTimes(logging.Handler):
    """How long each of the Manager's group reconfigures took (the backend's part of a recovery),
    from the Manager's own log lines before and after it: [(wall clock at its end, seconds)]."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.times: list[tuple[float, float]] = []
        self.began: float | None = None
        logger = logging.getLogger("torchft.manager")
        logger.setLevel(logging.INFO)
        logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "reconfiguring for quorum_id" in message:
            self.began = record.created
        elif "resetting fr recording" in message and self.began is not None:
            self.times.append((record.created, record.created - self.began))
            self.began = None


def replica(args: argparse.Namespace) -> int:
    from torchft import Manager

    out = Path(args.out)
    timeout = timedelta(seconds=args.timeout)
    reconfigures = ReconfigureTimes()
    pg = native_group(args.backend, args.store_port, timeout, args.replica, args.replicas)
    model = make_model(args.grad_mib)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    # This replica group's own store (one rank here); the Manager's server uses it.
    own_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=pg,
        min_replica_size=args.replicas - 1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), optimizer.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": optimizer.state_dict()},
        replica_id=f"replica_{args.replica}",
        store_addr="127.0.0.1",
        store_port=own_store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        hostname="127.0.0.1",
        timeout=timeout,
        quorum_timeout=timeout,
        connect_timeout=timeout,
        use_async_quorum=args.algorithm != "diloco",  # DiLoCo requires the quorum before each sync
    )
    if not args.restarted:
        # The first replicas start together, so that the first quorum has all of them: the
        # Lighthouse waits for replicas that heartbeat (have a Manager), and one still importing
        # torch would join a later quorum and heal, as a restarted one does.
        launcher = dist.TCPStore("127.0.0.1", args.store_port, is_master=False, timeout=timeout)
        launcher.add("started", 1)
        deadline = time.monotonic() + args.timeout
        while int(launcher.add("started", 0)) < args.replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {args.replica}: the others did not start within {args.timeout} s")
            time.sleep(0.01)
    all_reduced = []  # wall clock at the end of each gradient bucket's all_reduce (DDP)
    train_step, algorithm = make_algorithm(args, manager, model, optimizer, all_reduced)
    steps = []  # one entry a Manager step: see below
    g = torch.Generator().manual_seed(args.replica)
    every = 1 if args.algorithm == "ddp" else args.sync_every
    with algorithm:
        t0, inner = time.perf_counter(), 0
        while True:
            before = manager.current_step()
            train_step(torch.randn(8, 512, generator=g))
            inner += 1
            if inner % every:
                continue  # LocalSGD and DiLoCo: the Manager takes part every `every` steps
            # The step (DDP's) or the sync (LocalSGD's, DiLoCo's) commits only where every
            # replica's all_reduce succeeded; then the Manager's step count moves on.
            step, participants = manager.current_step(), manager.num_participants()
            # (step reached, seconds since the last one, replicas taking part, committed, wall clock)
            steps.append((step, time.perf_counter() - t0, participants, step > before, time.time()))
            t0 = time.perf_counter()
            # Whole or not at all (the launcher polls it): written aside, then renamed over.
            (out / f"progress_{args.replica}.new").write_text(str(step))
            (out / f"progress_{args.replica}.new").replace(out / f"progress_{args.replica}")
            # Stop together: a step every replica took part in, at or past the last one.
            if step >= args.steps and participants == args.replicas:
                break
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / f"final_{args.replica}.pt")
    bench = {mib: bench_allreduce(manager, mib) for mib in args.bench_mib}
    result = {"steps": steps, "bench": bench, "reconfigures": reconfigures.times, "all_reduced": all_reduced}
    (out / f"steps_{args.replica}.json").write_text(json.dumps(result))
    manager.shutdown(wait=False)
    if hasattr(pg, "shutdown"):
        pg.shutdown()
    return 0


def make_algorithm(args, manager, model, optimizer, all_reduced):
    """One training step (a function of the batch) and the context it runs in, for
    `args.algorithm`: torchft's DDP (every step's gradients averaged across replicas), LocalSGD
    (the parameters averaged every `sync_every` steps) or DiLoCo (the pseudo-gradients, every
    `sync_every` steps, through an outer Nesterov optimizer)."""
    from torchft.ddp import DistributedDataParallel
    from torchft.local_sgd import DiLoCo, LocalSGD
    from torchft.optim import OptimizerWrapper

    def local_step(x: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()

    if args.algorithm == "localsgd":
        return local_step, LocalSGD(manager, model, optimizer, sync_every=args.sync_every)
    if args.algorithm == "diloco":
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        return local_step, DiLoCo(manager, [model], optimizer, outer, sync_every=args.sync_every, pin_memory=False)

    class TimedDDP(DistributedDataParallel):
        @staticmethod
        def _comm_hook(state, bucket):  # torchft's: Manager.allreduce of the bucket, waited for
            future = DistributedDataParallel._comm_hook(state, bucket)
            all_reduced.append(time.time())
            return future

    ddp, opt = TimedDDP(manager, model), OptimizerWrapper(manager, optimizer)

    def ddp_step(x: torch.Tensor) -> None:
        opt.zero_grad()  # starts the Manager's quorum for this step
        ddp(x).square().mean().backward()  # Manager.allreduce of each gradient bucket
        opt.step()  # Manager.should_commit, then the optimizer's step where it commits

    return ddp_step, contextlib.nullcontext()


def bench_allreduce(manager, mib: int, buckets: int = 8, reps: int = 10) -> float:
    """Median seconds of one step's gradient all_reduce through the Manager, as torchft's DDP
    and LocalSGD make it: `mib` MiB in `buckets` buckets, all started, then all waited for."""
    tensors = [torch.ones(mib * 2**18 // buckets) for _ in range(buckets)]
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        works = [manager.allreduce(t) for t in tensors]
        for w in works:
            w.wait()
        times.append(time.perf_counter() - t0)
    if manager.errored():
        raise RuntimeError(f"the benchmark's all_reduce failed: {manager.errored()}")
    return statistics.median(times[2:])


def launch(args: argparse.Namespace) -> int:
    os.environ.setdefault("RUST_LOG", "warn")  # the Lighthouse logs every quorum request at "info"
    from torchft._torchft import LighthouseServer

    out = Path(args.out or f"/tmp/torchft_train_{os.getpid()}")
    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("progress_*"), *out.glob("final_*.pt"), *out.glob("steps_*.json"), *out.glob("replica_*.log")]:
        stale.unlink()  # an earlier run's, in a folder given again
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.replicas - 1, join_timeout_ms=2000, quorum_tick_ms=10,
                                  heartbeat_timeout_ms=1000)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    deadline = time.monotonic() + args.deadline

    def start(r: int, restarted: bool = False) -> subprocess.Popen:
        cmd = [sys.executable, __file__, "--replica", str(r), "--lighthouse", lighthouse.address(),
               "--store-port", str(store.port), "--out", str(out)] + ["--restarted"] * restarted
        for name in ("replicas", "steps", "grad_mib", "backend", "timeout", "algorithm", "sync_every"):
            cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        cmd += ["--bench-mib", *map(str, args.bench_mib)]
        log = open(out / f"replica_{r}.log", "a")
        # One intra-op thread per process, as torchrun sets it: three processes with a pool of
        # threads each that spin after every parallel kernel (the Manager's gradient averaging)
        # slowed every backend's all_reduce here 2-8 times.
        env = {"OMP_NUM_THREADS": "1", **os.environ}
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    procs = {r: start(r) for r in range(args.replicas)}
    victim = args.replicas - 1
    killed = killed_wall = None
    try:
        while any(p.poll() is None for p in procs.values()):
            if time.monotonic() > deadline:
                say(f"FAILED: not done after {args.deadline} s; logs in {out}")
                return 1
            failed = [r for r, p in procs.items() if p.poll() not in (None, 0)]
            if failed:
                say(f"FAILED: replica {failed[0]} exited with {procs[failed[0]].returncode}; logs in {out}")
                return 1
            progress = out / f"progress_{victim}"
            reached = int(progress.read_text()) if progress.exists() else -1
            if args.kill_at and killed is None and reached >= args.kill_at:
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                killed, killed_wall = int(progress.read_text()), time.time()  # its last step, now final
                say(f"step {killed}: replica {victim} killed (SIGKILL), started again")
                procs[victim] = start(victim, restarted=True)
            time.sleep(0.02)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
        lighthouse.shutdown()

    finals = [torch.load(out / f"final_{r}.pt") for r in range(args.replicas)]
    for r in range(1, args.replicas):
        for name, tensor in finals[0].items():
            if not torch.equal(tensor, finals[r][name]):
                say(f"FAILED: replica {r}'s {name} differs from replica 0's; logs in {out}")
                return 1
    report(args, out, killed, killed_wall)
    say("OK")
    return 0


def report(args: argparse.Namespace, out: Path, killed: int | None, killed_wall: float | None) -> None:
    """Each replica's median step time over the steps all replicas took (after warm-up, before
    the kill) and its Manager.allreduce times; then, after the kill, when the survivors' step
    failed (the backend's part: the peer's loss to an error), when they trained on (the
    Lighthouse's heartbeat timeout, the new quorum, the reconfigure) and when the restarted
    replica took part again (its start, its Manager, its heal)."""
    results = [json.loads((out / f"steps_{r}.json").read_text()) for r in range(args.replicas)]
    for r, result in enumerate(results):
        steps = result["steps"]
        full = [s for step, s, n, ok, _ in steps
                if n == args.replicas and ok and step > WARMUP and (killed is None or step < killed)]
        line = f"replica {r}: {len(steps)} steps, final step {steps[-1][0]}"
        if full:
            what = "step" if args.algorithm == "ddp" else f"{args.sync_every} steps and a sync"
            line += f", {what}: median {statistics.median(full) * 1e3:.1f} ms over {len(full)}"
        if result["bench"]:
            line += "; Manager.allreduce, 8 buckets: " + ", ".join(
                f"{mib} MiB {t * 1e3:.1f} ms" for mib, t in result["bench"].items())
        say(line)
    if killed_wall is not None:
        since = lambda t: f"{(t - killed_wall) * 1e3:.0f} ms"  # noqa: E731
        for r, result in enumerate(results[:-1]):
            after = [(ok, end) for _, _, _, ok, end in result["steps"] if end > killed_wall]
            # A kill while the survivors' all_reduce runs fails that step; one between steps
            # leaves it to the Lighthouse to drop the replica from the next quorum.
            failed = next((end for ok, end in after if not ok), None)
            again = next((end for ok, end in after if ok and (failed is None or end > failed)), None)
            reconfigured = next(((end, t) for end, t in result["reconfigures"] if end > killed_wall), None)
            first = reconfigured and next((end for end in result["all_reduced"] if end > reconfigured[0]), None)
            say(f"replica {r} after the kill: " + (f"its step failed at {since(failed)}, " if failed else "")
                + (f"the group reconfigured in {reconfigured[1] * 1e3:.1f} ms, " if reconfigured else "")
                + (f"its first all_reduce done {(first - reconfigured[0]) * 1e3:.1f} ms later, " if first else "")
                + f"trained on (committed) at {since(again) if again else 'never'}")
        back = next((end for _, _, n, ok, end in results[-1]["steps"] if ok), None)
        say(f"replica {args.replicas - 1} restarted: its first committed step at {since(back) if back else 'never'}")
    say(f"{args.backend}, {args.algorithm}, {args.grad_mib} MiB of parameters, {args.replicas} replicas")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["rustc10d", "gloo", "torchft-gloo"], default="rustc10d")
    p.add_argument("--algorithm", choices=["ddp", "localsgd", "diloco"], default="ddp")
    p.add_argument("--sync-every", type=int, default=4, help="LocalSGD's and DiLoCo's steps between syncs")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--grad-mib", type=int, default=8)
    p.add_argument("--kill-at", type=int, default=20, help="0: kill none")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds: Manager, quorum and group timeouts")
    p.add_argument("--deadline", type=float, default=240.0, help="seconds the whole run may take")
    p.add_argument("--bench-mib", type=int, nargs="*", default=[],
                   help="after training, time Manager.allreduce of this many MiB (in 8 buckets)")
    p.add_argument("--out", help="folder for logs and results (default: a new one in /tmp)")
    # set by the launcher for each replica process
    p.add_argument("--replica", type=int)
    p.add_argument("--lighthouse")
    p.add_argument("--store-port", type=int)
    p.add_argument("--restarted", action="store_true")
    args = p.parse_args()
    if not hasattr(dist.ProcessGroup, "reconfigure"):
        say(f"torch {torch.__version__} has no native process group reconfigure: torchft needs torch 2.14 on")
        return 2
    return replica(args) if args.replica is not None else launch(args)


if __name__ == "__main__":
    sys.exit(main())
