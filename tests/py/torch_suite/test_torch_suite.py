"""torch's own conformance suite, DistributedTest, on the backend under test: the tests Gloo
passes at world size 2 on CPU (tests/py/torch_suite/tests.txt), run by tests/py/torch_suite/run.py,
which says how. Its ranks' output stays in the test's tmp_path; its summary is in the assertion."""

import sys
from pathlib import Path

import pytest

import checks
import harness

RUN = Path(__file__).with_name("run.py")
DEADLINE = 300  # seconds (the suite takes about 30 here); no test starts after it, one runs 120 at most


@pytest.mark.timeout(DEADLINE + 240)
def test_torch_distributed_test_suite(tmp_path):
    cmd = [sys.executable, str(RUN), "--backend", checks.BACKEND, "--deadline", str(DEADLINE),
           "--logs", str(tmp_path / "tests"), "--report", str(tmp_path / "report.json")]
    [proc] = harness.run_processes({"suite": cmd}, timeout=DEADLINE + 180, log_dir=tmp_path)
    last = (proc.stdout.strip().splitlines() or ["no output"])[-1]  # the counts, and which failed
    assert proc.returncode == 0, f"{last}\n{proc.describe()}\nstdout:\n{proc.stdout[-30000:]}"
