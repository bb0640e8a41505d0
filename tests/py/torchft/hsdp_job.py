"""HSDP through torchft on rustc10d, checked against one process (tests/py/torchft/test_torchft.py runs it).

Two replica groups, each a torchrun job of 2 ranks: FSDP2 (`fully_shard`) inside a replica group
over its default group (rustc10d), and torchft's Manager across replica groups over
`rustc10d.reconfigurable_group`, one per group rank, fed by FSDP2's all-reduce hook with each
reduce-scattered gradient shard. After STEPS steps of SGD every parameter, gathered whole, must
match one process that took each step on the mean gradient of the four ranks' batches.

    python tests/py/torchft/hsdp_job.py [--out DIR]   # prints "OK" at the end, exits non-zero otherwise
"""

import argparse
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

REPLICAS, GROUP_SIZE, STEPS, LR = 2, 2, 5, 0.1


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(step: int, global_rank: int) -> torch.Tensor:
    return torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + global_rank))


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).square().mean()


def worker(out: Path) -> int:
    import rustc10d
    from torch.distributed.fsdp import fully_shard
    from torchft import Manager
    from torchft.optim import OptimizerWrapper

    replica, timeout = int(os.environ["REPLICA"]), timedelta(seconds=30)
    dist.init_process_group("rustc10d", timeout=timeout)  # the replica group: FSDP2's
    group_rank = dist.get_rank()
    shared = dist.TCPStore("127.0.0.1", int(os.environ["SHARED_STORE_PORT"]), is_master=False, timeout=timeout)
    across = rustc10d.reconfigurable_group(dist.PrefixStore(f"hsdp/group_rank_{group_rank}", shared), timeout=timeout)
    manager = Manager(
        pg=across, min_replica_size=REPLICAS, load_state_dict=None, state_dict=None, init_sync=False,
        replica_id=f"replica_{replica}", rank=group_rank, world_size=GROUP_SIZE,  # the store: torchrun's
        lighthouse_addr=os.environ["LIGHTHOUSE"], hostname="127.0.0.1", use_async_quorum=False,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)

    model = make_model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    hooked = []

    def across_replicas(shard: torch.Tensor) -> None:
        manager.allreduce(shard).wait()  # the average over the replicas' shards, in place
        hooked.append(shard.numel())

    for module in model.modules():
        if hasattr(module, "set_all_reduce_hook"):
            module.set_all_reduce_hook(across_replicas)
    opt = OptimizerWrapper(manager, torch.optim.SGD(model.parameters(), lr=LR))
    for step in range(STEPS):
        opt.zero_grad()
        loss_of(model, batch(step, replica * GROUP_SIZE + group_rank)).backward()
        opt.step()
        assert manager.current_step() == step + 1, f"step {step} was not committed: {manager.errored()}"
    assert hooked, "FSDP2 never called the all-reduce hook"
    whole = {name: p.full_tensor() for name, p in model.named_parameters()}
    if group_rank == 0:
        torch.save(whole, out / f"replica_{replica}.pt")
    manager.shutdown(wait=False)
    across.shutdown()
    dist.destroy_process_group()
    return 0


def reference() -> dict:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        ranks = range(REPLICAS * GROUP_SIZE)
        (sum(loss_of(model, batch(step, g)) for g in ranks) / len(ranks)).backward()
        opt.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def launch(out: Path) -> int:
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    out.mkdir(parents=True, exist_ok=True)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=REPLICAS, join_timeout_ms=5000, quorum_tick_ms=10)
    shared = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    for replica in range(REPLICAS):
        env = {**os.environ, "REPLICA": str(replica), "LIGHTHOUSE": lighthouse.address(),
               "SHARED_STORE_PORT": str(shared.port), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(GROUP_SIZE),
               __file__, "--out", str(out)]
        log = open(out / f"replica_{replica}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 120
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        late = [p.poll() is None for p in procs]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.shutdown()
    if any(late):
        print(f"FAILED: replica groups {[r for r, x in enumerate(late) if x]} not done after 120 s; logs in {out}")
        return 1
    if any(p.returncode != 0 for p in procs):
        print(f"FAILED: replica groups exited with {[p.returncode for p in procs]}; logs in {out}")
        return 1
    expected = reference()
    for replica in range(REPLICAS):
        got = torch.load(out / f"replica_{replica}.pt")
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, msg=lambda m: f"replica {replica}'s {name}: {m}")
    print(f"{REPLICAS} replica groups of {GROUP_SIZE} ranks, {STEPS} HSDP steps: parameters match one process")
    print("OK")
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=f"/tmp/hsdp_job_{os.getpid()}")
    args = p.parse_args()
    return worker(Path(args.out)) if "REPLICA" in os.environ else launch(Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
