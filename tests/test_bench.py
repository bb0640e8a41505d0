"""Smoke test of the benchmark: `python -m rustc10d.bench --quick` runs to the end, and every op
it times on rustc10d also gave the right answer. Timings are not asserted: the machine is shared."""

import json
import os
import signal
import subprocess
import sys

import pytest

from rustc10d.bench import OPS

TIMEOUT = 240  # --quick takes well under 2 minutes on 2 cores


@pytest.mark.timeout(TIMEOUT + 60)
def test_quick_bench(tmp_path):
    report_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [sys.executable, "-m", "rustc10d.bench", "--quick", "--json", str(report_path), "--plot", str(plot_path)]
    # its own process group: on timeout, kill the launcher and the ranks it started together
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"bench --quick still running after {TIMEOUT} s; output tail:\n{output[-4000:]}")
    assert proc.returncode == 0, f"bench --quick exited {proc.returncode}; output tail:\n{output[-4000:]}"

    report = json.loads(report_path.read_text())
    assert report["ok"] and not report["failures"], report["failures"]
    for name, op in OPS.items():
        for dtype in op.dtypes:
            entries = [e for e in report["results"] if (e["op"], e["dtype"]) == (name, dtype)]
            assert entries, f"no results for {name} {dtype}"
            for e in entries:
                assert set(e["backends"]) == {"rustc10d-shm", "rustc10d-tcp", "gloo"}, e["backends"].keys()
                where = f"{name} {dtype} {e['bytes']} B"
                for series in ("rustc10d-shm", "rustc10d-tcp"):
                    rust = e["backends"][series]
                    assert rust["status"] == "ok" and rust["times_s"], f"{where}: {series} {rust}"
                gloo = e["backends"]["gloo"]
                assert gloo["status"] in ("ok", "unsupported"), f"{where}: gloo {gloo}"
    assert set(report["idle_cpu_fraction"]) == {"2"} and 0 <= report["idle_cpu_fraction"]["2"] < 1, report
    assert plot_path.exists() or "matplotlib is not installed" in output
