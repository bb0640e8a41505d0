"""Every collective, in every form torch offers, against plain arithmetic (checks.py and
checks_ops.py, suite "collectives")."""

import pytest

import harness


@pytest.mark.parametrize(("world", "check"), harness.check_params("collectives"))
def test_collective(jobs, world, check):
    jobs.verify(world, check)
