"""send/recv/isend/irecv and the honesty of their Work objects (checks.py, suite "p2p")."""

import pytest

import harness


@pytest.mark.parametrize(("world", "check"), harness.check_params("p2p"))
def test_p2p(jobs, world, check):
    jobs.get(world).verify(check)
