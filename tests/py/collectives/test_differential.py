"""The differential suite: generated calls, legal and illegal, of every op, dtype, reduce op,
shape, layout and group, checked against arithmetic (checks_differential.py, suite
"differential"; settings and replay there). Runs over shared memory, TCP, staged like CUDA
tensors, and without the shared arena."""

import pytest

import harness
from checks_differential import chunk_start, current_call_path

EXTRA_VARIANTS = ("noarena",)
VARIANTS = harness.JOB_VARIANTS + (EXTRA_VARIANTS if harness.checks.BACKEND == "rustc10d" else ())
# (world, variant) -> the jobs started again after a rank died: [(first call, Job)]
_RESTARTED: dict[tuple[int, str], list[tuple[int, harness.Job]]] = {}


def job_for(jobs: harness.JobCache, world: int, transport: str, check: str) -> harness.Job:
    """The job that ran `check`. A rank that dies (a panic aborts the process) takes every
    later chunk of its job with it: those run in a job started again from the first chunk that
    did not run, so a crash costs one chunk, as a wrong result does."""
    start = chunk_start(check)
    chain = [(0, jobs.get(world, "differential", transport))] + _RESTARTED.get((world, transport), [])
    _, job = max((entry for entry in chain if entry[0] <= start), key=lambda entry: entry[0])
    if not job.died_before(check):
        return job
    log_dir = jobs.tmp_path_factory.mktemp(f"job-w{world}-differential-{transport}-from{start}-")
    job = harness.Job(world, log_dir, "differential", transport, extra_env={"RUSTC10D_DIFF_FROM": str(start)})
    _RESTARTED.setdefault((world, transport), []).append((start, job))
    return job


@pytest.mark.parametrize(("world", "check", "transport"),
                         harness.transport_check_params("differential", extra_variants=EXTRA_VARIANTS))
def test_differential(jobs, world, check, transport):
    job = job_for(jobs, world, transport, check)
    try:
        job.verify(check)
    except pytest.fail.Exception as e:
        # a rank that died mid-chunk could not say which call killed it: its last note does
        notes = [f"rank {r}: {path.read_text()}" for r in range(world)
                 if (path := current_call_path(job.log_dir, r)).exists()
                 and job.results[r]["checks"].get(check) is None]
        if not notes:
            raise
        pytest.fail(f"{e.msg}\nthe call each unfinished rank had started:\n" + "\n".join(notes), pytrace=False)


@pytest.mark.parametrize("transport", VARIANTS)
@pytest.mark.parametrize("world", harness.checks.WORLD_SIZES)
def test_differential_job_shuts_down_cleanly(jobs, world, transport):
    """After the calls (mismatches and refusals among them) every rank destroys the process
    group and exits 0."""
    jobs.get(world, "differential", transport).verify_clean_exit()
