"""torchft, Meta's fault-tolerant training library, on rustc10d: examples/torchft_train.py (replica
groups as processes, a real Lighthouse, DDP, LocalSGD or DiLoCo through the Manager, a replica
SIGKILLed and started again, weights checked equal), HSDP (tests/py/torchft/hsdp_job.py: FSDP2
inside replica groups, checked against one process), and torchft's own tests of native process
groups (tests/py/torchft/run_torchft_tests.py). torchft needs torch 2.14 on (the native reconfigure API);
scripts/test.sh installs the pinned torchft-nightly there and sets RUSTC10D_REQUIRE_TORCHFT=1,
so that a missing torchft fails instead of skipping."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import checks
import harness


@pytest.fixture
def torchft():
    if checks.BACKEND != "rustc10d":
        pytest.skip("rustc10d's reconfigurable group")
    if not hasattr(dist.ProcessGroup, "reconfigure"):
        pytest.skip("torch before 2.14 has no process group reconfigure, which torchft's native groups need")
    if importlib.util.find_spec("torchft") is None:
        if os.environ.get("RUSTC10D_REQUIRE_TORCHFT") == "1":
            pytest.fail("torchft is not installed: scripts/test.sh installs torchft-nightly (scripts/lib.sh pins it)")
        pytest.skip("torchft is not installed (pip install torchft-nightly)")


RECONFIGURABLE_GROUP_JOB = """
from datetime import timedelta
import torch, torch.distributed as dist, rustc10d
from torch._C._distributed_c10d import ReconfigureOptions
store = dist.HashStore()
pg = rustc10d.reconfigurable_group(store, timeout=timedelta(seconds=10))
assert pg.supports_reconfigure
try:
    pg.allreduce([torch.ones(2)]).wait()
    raise AssertionError("an all_reduce before the first reconfigure did not raise")
except RuntimeError as e:
    assert "no members yet" in str(e) and "reconfigure" in str(e), e
opts = ReconfigureOptions(); opts.uuid = 7; opts.handles = [pg.get_reconfigure_handle()]
pg.reconfigure(opts).wait()
t = torch.full((3,), 2.0)
pg.allreduce([t]).wait()
assert (pg.rank(), pg.size()) == (0, 1) and t.tolist() == [2.0, 2.0, 2.0], (pg.rank(), pg.size(), t)
# What a reconfigure leaves in the Store: its counts of members and of incarnations, which tell
# a uuid used before; each member's record is deleted once every member has read it.
kept = [k for k in ("rustc10d/reconfigure/7/members", "rustc10d/reconfigure/7/rustc10d/joined") if store.check([k])]
assert len(kept) == 2 and store.num_keys() == 2, (kept, store.num_keys())
for bad in ("x", {"segment_bytes": 1}):
    try:
        rustc10d.reconfigurable_group(store, options=bad)
        raise AssertionError(f"options={bad!r} was taken")
    except TypeError as e:
        assert "rustc10d.Options" in str(e), e
pg.shutdown()
print("OK")
"""


@pytest.mark.timeout(120)
def test_reconfigurable_group_refuses_ops_until_reconfigured(tmp_path):
    """rustc10d.reconfigurable_group alone (no torchft): a group that supports reconfigure, whose
    ops raise, saying to reconfigure, until its first reconfigure; then a group of its handles,
    which leaves two counts in the Store and no record; options that are not rustc10d.Options
    are refused."""
    if checks.BACKEND != "rustc10d" or not hasattr(dist.ProcessGroup, "reconfigure"):
        pytest.skip("rustc10d's reconfigurable group, torch 2.14 on")
    script = tmp_path / "reconfigurable_group_job.py"
    script.write_text(RECONFIGURABLE_GROUP_JOB)
    [proc] = harness.run_processes({"job": [sys.executable, str(script)]}, timeout=100, log_dir=tmp_path)
    assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    assert "OK" in proc.stdout.splitlines(), proc.stdout


@pytest.mark.timeout(200)
@pytest.mark.parametrize("algorithm", ["ddp", "localsgd", "diloco"])
def test_torchft_training_survives_a_killed_replica(tmp_path, torchft, algorithm):
    """3 replicas train through torchft's Manager on rustc10d.reconfigurable_group (DDP every
    step; LocalSGD and DiLoCo syncing every 4); replica 2 is SIGKILLed at (Manager) step 20, or 8
    for the syncing ones, and started again: the survivors' all_reduce fails or the Lighthouse
    drops it, they train on as two, the new process heals from a survivor and joins, and all
    three end on the same step with equal weights."""
    kill_at = 20 if algorithm == "ddp" else 8
    cmd = [sys.executable, str(harness.REPO / "examples" / "torchft_train.py"), "--out", str(tmp_path / "run"),
           "--algorithm", algorithm, "--kill-at", str(kill_at), "--steps", str(2 * kill_at), "--deadline", "150"]
    if algorithm == "ddp":
        cmd += ["--bench-mib", "1"]
    [proc] = harness.run_processes({"launcher": cmd}, timeout=170, log_dir=tmp_path)
    assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    lines = proc.stdout.splitlines()
    assert "OK" in lines, proc.stdout
    assert f"step {kill_at}: replica 2 killed (SIGKILL), started again" in lines, proc.stdout
    for r in (0, 1):
        survivor = next(line for line in lines if line.startswith(f"replica {r} after the kill:"))
        assert "trained on (committed) at" in survivor and "never" not in survivor, proc.stdout
    restarted = next(line for line in lines if line.startswith("replica 2 restarted:"))
    assert "never" not in restarted, proc.stdout


@pytest.mark.timeout(200)
def test_torchfts_own_native_group_tests_pass_on_rustc10d(tmp_path, torchft):
    """torchft's reconfigure_test._resize_worker (resize, abort, recover) and manager_integ_test's
    native test_ddp_recovery (sync and async quorum), on rustc10d."""
    cmd = [sys.executable, str(Path(__file__).with_name("run_torchft_tests.py"))]
    [proc] = harness.run_processes({"torchft_tests": cmd}, timeout=170, log_dir=tmp_path)
    assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    assert "OK" in proc.stdout.splitlines(), proc.stdout
    assert "reconfigure_test._resize_worker on rustc10d: passed" in proc.stdout, proc.stdout


@pytest.mark.timeout(200)
def test_hsdp_fsdp2_inside_replica_groups_and_rustc10d_across(tmp_path, torchft):
    """Two replica groups of 2 ranks under torchrun: FSDP2 over each group's rustc10d default
    group, and the Manager's all_reduce of each gradient shard (FSDP2's all-reduce hook) over
    rustc10d.reconfigurable_group across them; the parameters after 5 steps match one process."""
    cmd = [sys.executable, str(Path(__file__).with_name("hsdp_job.py")), "--out", str(tmp_path / "run")]
    [proc] = harness.run_processes({"hsdp": cmd}, timeout=170, log_dir=tmp_path)
    assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    assert "OK" in proc.stdout.splitlines(), proc.stdout
