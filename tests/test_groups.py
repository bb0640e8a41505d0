"""Sub-groups, new_subgroups, sequence numbers and monitored_barrier (checks_ops.py, suite
"groups")."""

import pytest

import harness


@pytest.mark.parametrize(("world", "check"), harness.check_params("groups"))
def test_group(jobs, world, check):
    jobs.verify(world, check)
