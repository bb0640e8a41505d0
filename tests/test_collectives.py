"""all_reduce, broadcast and barrier against plain arithmetic (checks.py, suite "collectives")."""

import pytest

import harness


@pytest.mark.parametrize(("world", "check"), harness.check_params("collectives"))
def test_collective(jobs, world, check):
    jobs.get(world).verify(check)
