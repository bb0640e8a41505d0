"""Every collective, in every form torch offers, against plain arithmetic (checks.py and
checks_ops.py, suite "collectives")."""

import pytest

import harness


@pytest.mark.parametrize(("world", "check", "transport"), harness.transport_check_params("collectives"))
def test_collective(jobs, world, check, transport):
    jobs.verify(world, check, transport)
