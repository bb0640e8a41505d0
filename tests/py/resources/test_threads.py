"""Threads per rank do not grow with peers or groups: W=8 ranks, each in the world group and
64 groups over all of them (as DeviceMesh, FSDP and tensor parallelism create them), each group
used once (tests/py/resources/threads_job.py). rustc10d needs one engine thread per group plus one I/O thread
per process; after destroy_process_group() none is left. (Gloo, for comparison, ran 196 threads
per rank in this job and left 193 behind.)"""

import json
from pathlib import Path

import pytest

import checks
import harness

WORLD, GROUPS = 8, 64


@pytest.mark.timeout(300)
@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d's own thread budget")
def test_threads_per_rank_are_bounded_and_none_is_left(tmp_path):
    procs = harness.launch_ranks(WORLD, ["--groups", str(GROUPS)], timeout=240, log_dir=tmp_path,
                                 script=Path(__file__).with_name("threads_job.py"))
    results = []
    for proc in procs:
        assert proc.returncode == 0, proc.describe()
        results += [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines()
                    if line.startswith("RESULT ")]
    assert len(results) == WORLD, results
    for r in results:
        # the interpreter's own threads, one engine per group (the world group too), one I/O thread
        assert r["live"] - r["before"] <= GROUPS + 1 + 2, r
        assert not [n for n in r["left"] if n.startswith("rustc10d")], r
