"""examples/allreduce_demo.py runs under torchrun and reports OK."""

import sys

import pytest

import checks
import harness


@pytest.mark.timeout(180)
def test_allreduce_demo_under_torchrun(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(harness.REPO / "examples" / "allreduce_demo.py"), "--backend", checks.BACKEND]
    [proc] = harness.run_processes({"torchrun": cmd}, timeout=150, log_dir=tmp_path)
    assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    lines = proc.stdout.splitlines()
    assert "OK" in lines, proc.stdout
    assert "[rank 1]" in proc.stdout, proc.stdout
