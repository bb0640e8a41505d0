"""Each example in examples/ runs under torchrun and reports OK."""

import sys

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
