"""A soak: W = 4, thousands of mixed collectives and random point-to-point ops, results checked;
file descriptors and memory must be as stable at the end as after the warm-up."""

import json

import pytest

import checks
import harness


@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d's resource use")
@pytest.mark.timeout(300)
def test_soak_keeps_fds_and_memory_stable(tmp_path):
    procs = harness.launch_ranks(4, ["--steps", "3000"], timeout=240, log_dir=tmp_path,
                                 script=harness.REPO / "tests" / "soak_job.py")
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, proc.describe()
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
        r = json.loads(line[len("RESULT "):])
        assert r["late"]["fds"] <= r["early"]["fds"], (rank, r)
        assert r["late"]["rss_mb"] - r["early"]["rss_mb"] < 64, (rank, r)
