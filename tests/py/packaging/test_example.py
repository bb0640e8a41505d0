"""Each example in examples/ runs under torchrun and reports OK; so does tests/py/packaging/every_op_job.py, the
job that scripts/torch_matrix.sh runs on each supported torch, plain and staged like CUDA tensors."""

import sys
from pathlib import Path

import pytest

import checks
import harness

# example -> a line its output must have besides the OK line, showing that it did its work
EXAMPLES = {
    "allreduce_demo.py": "[rank 1]",  # every rank reports
    "ddp_train.py": "step 0: loss",
    "pipeline_train.py": "step 0: loss",
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("example", EXAMPLES)
def test_example_under_torchrun(tmp_path, example):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(harness.REPO / "examples" / example), "--backend", checks.BACKEND]
    [proc] = harness.run_processes({"torchrun": cmd}, timeout=150, log_dir=tmp_path)
    assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    assert "OK" in proc.stdout.splitlines(), proc.stdout
    assert EXAMPLES[example] in proc.stdout, proc.stdout


@pytest.mark.timeout(180)
@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="uses ops Gloo lacks (PREMUL_SUM, gather_into_tensor)")
@pytest.mark.parametrize("staged", [False, True], ids=["plain", "staged"])
def test_every_op_job_under_torchrun(tmp_path, staged):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
           str(Path(__file__).with_name("every_op_job.py"))]
    env = harness.worker_env({"RUSTC10D_TEST_STAGING": "1"} if staged else {})
    [proc] = harness.run_processes({"torchrun": cmd}, timeout=150, log_dir=tmp_path, env=env)
    assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    assert "OK" in proc.stdout.splitlines(), proc.stdout


@pytest.mark.timeout(180)
@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="Gloo cannot shrink a group")
def test_elastic_training_goes_on_without_a_lost_rank(tmp_path):
    """examples/elastic_train.py on 4 ranks: rank 3 is lost at step 5, the survivors shrink the
    group and train on, and their parameters match one process on what they saw."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(harness.REPO / "examples" / "elastic_train.py")]
    [proc] = harness.run_processes({"torchrun": cmd}, timeout=150, log_dir=tmp_path)
    assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    assert "OK" in proc.stdout.splitlines(), proc.stdout
    assert "step 5: lost rank 3" in proc.stdout and "step 11: loss" in proc.stdout, proc.stdout
