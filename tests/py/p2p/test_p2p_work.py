"""send/recv/isend/irecv, receives from any source, batch_isend_irecv, and the honesty of their
Work objects (checks.py and checks_ops.py, suite "p2p")."""

import pytest

import harness


@pytest.mark.parametrize(("world", "check", "transport"), harness.transport_check_params("p2p"))
def test_p2p(jobs, world, check, transport):
    jobs.verify(world, check, transport)
