"""Sub-groups, new_subgroups, sequence numbers and monitored_barrier (checks_ops.py, suite
"groups")."""

import pytest

import harness


@pytest.mark.parametrize(("world", "check"), harness.check_params("groups"))
def test_group(jobs, world, check):
    jobs.verify(world, check)


BOUND_DEVICE_JOB = r"""
import sys
from datetime import timedelta
import torch, torch.distributed as dist
import rustc10d
args = dict(zip(sys.argv[1::2], sys.argv[2::2]))
rank, world = int(args["--rank"]), int(args["--world"])
host, port = args["--store"].split(":")
store = dist.TCPStore(host, int(port), world, is_master=False, timeout=timedelta(seconds=30))
dist.init_process_group("rustc10d", store=store, rank=rank, world_size=world,
                        timeout=timedelta(seconds=20), device_id=torch.device("cpu:0"))
group = dist.new_group([0, 1])
if rank < 2:
    t = torch.ones(3)
    dist.all_reduce(t, group=group)
    assert t.tolist() == [2.0] * 3, t
else:
    assert group == dist.GroupMember.NON_GROUP_MEMBER, group
dist.destroy_process_group()
print("rank", rank, "ok", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_new_group_on_a_bound_device_leaves_non_members_out(tmp_path):
    """With init_process_group(device_id=...), torch makes a new group's non-members call the
    parent backend's perform_nocolor_split, since it supports splitting: ours has it (and it has
    nothing to do). Before, rank 2 raised AttributeError. torch 2.11 binds only accelerators."""
    import checks
    import torch
    if checks.BACKEND != "rustc10d":
        pytest.skip("rustc10d's own Python class")
    if torch.__version__.startswith("2.11."):
        pytest.skip("torch 2.11 binds a group to an accelerator only")
    script = tmp_path / "bound_device_job.py"
    script.write_text(BOUND_DEVICE_JOB)
    procs = harness.launch_ranks(3, [], timeout=90, log_dir=tmp_path, script=script, env=harness.worker_env())
    for proc in procs:
        assert proc.returncode == 0, proc.describe()
