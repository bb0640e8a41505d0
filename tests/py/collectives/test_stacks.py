"""The PyTorch stacks on the backend, end to end: DDP, FSDP2, pipelining, distributed checkpoint
and DeviceMesh (checks_stacks.py, suite "stacks"; each stack runs as a job of its own)."""

import pytest

import harness


@pytest.mark.parametrize(("world", "check"), harness.check_params("stacks"))
def test_stack(jobs, world, check):
    jobs.verify(world, check)


@pytest.mark.parametrize(("world", "job"), harness.job_params("stacks"))
def test_stack_job_shuts_down_cleanly(jobs, world, job):
    """After a stack's checks every rank destroys the process group and exits 0."""
    jobs.get(world, job).verify_clean_exit()
