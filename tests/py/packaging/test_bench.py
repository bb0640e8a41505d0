"""Smoke test of the benchmark: `python -m rustc10d.bench --quick` runs to the end, and every op
it times on rustc10d also gave the right answer. Timings are not asserted: the machine is shared."""

import json
import os
import signal
import subprocess
import sys

import pytest

from rustc10d.bench import OPS
from rustc10d import testbed

# The benchmark's plumbing is the same on every torch (pytest.ini).
pytestmark = pytest.mark.torch_independent

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


@pytest.mark.timeout(120)
def test_hosts_bench_counts_link_bytes(tmp_path):
    """--hosts 2 --link-gbit 1 at W=4 (2 ranks a host), tiny sizes: the results are right and each
    carries, per backend, the bytes every host sent over its link; an all-gather sends at least the
    half of its payload that must cross; rustc10d's hierarchical all-reduce sends 2(H-1)/H = 1 of
    its buffer, Gloo's ring 2(W-1)/W = 1.5."""
    try:  # skip where the test bed cannot be built, as the bench itself would
        with testbed.Hosts(2):
            pass
    except testbed.TestbedUnavailable as e:
        pytest.skip(f"no network namespaces here: {e}")
    report_path = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "rustc10d.bench", "--hosts", "2", "--link-gbit", "1", "--worlds", "4",
           "--ops", "all_reduce,all_gather_into_tensor,broadcast", "--dtypes", "float32", "--min-size", "8",
           "--max-size", "64K", "--step", "8192", "--rounds", "1", "--budget", "0.01", "--plot", "none",
           "--json", str(report_path), "--timeout", "80"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=100, stdin=subprocess.DEVNULL)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench --hosts exited {proc.returncode}; output tail:\n{output[-4000:]}"
    assert "2(H-1)/H = 1.00" in output and "link B/B" in output, output[-4000:]

    report = json.loads(report_path.read_text())
    assert report["ok"] and not report["failures"], report["failures"]
    assert report["reference"]["link_GBps"] > 0, report["reference"]
    assert len(report["results"]) == 6, [(e["op"], e["bytes"]) for e in report["results"]]
    for e in report["results"]:
        assert set(e["backends"]) == {"rustc10d-auto", "gloo"}, e["backends"].keys()
        for series, res in e["backends"].items():
            where = f"{e['op']} {e['bytes']} B {series}"
            assert res["status"] == "ok", f"{where}: {res}"
            link = res["link"]
            assert len(link["tx_bytes"]) == len(link["fence_bytes"]) == 2, f"{where}: {link}"
            assert link["per_byte"] == max(link["tx_bytes"]) / e["bytes"], f"{where}: {link}"
            if e["op"] == "all_gather_into_tensor" and e["bytes"] >= 64 << 10:  # half the blocks cross
                assert 0.5 <= link["per_byte"] < 1.0, f"{where}: {link}"
            if e["op"] == "all_reduce" and e["bytes"] >= 64 << 10:
                # Hierarchical: 2(H-1)/H = 1 (plus headers); Gloo's ring over all ranks: 2(W-1)/W = 1.5.
                if series == "gloo":
                    assert link["per_byte"] > 1.4, f"{where}: {link}"
                else:
                    assert 1.0 <= link["per_byte"] < 1.1, f"{where}: {link}"


@pytest.mark.timeout(150)
def test_latency_bench(tmp_path):
    """`bench --latency` at W=2, two sizes, few ops, DeepSpeed left out (CI does not install it):
    it runs to the end, every series has a median per mode and size, and every op was checked."""
    report_path = tmp_path / "latency.json"
    cmd = [sys.executable, "-m", "rustc10d.bench", "--latency", "--worlds", "2", "--sizes", "8,64K",
           "--iters", "20", "--rounds", "2", "--no-deepspeed", "--json", str(report_path), "--timeout", "100"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=130, stdin=subprocess.DEVNULL)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"bench --latency exited {proc.returncode}; output tail:\n{output[-4000:]}"
    assert "every op's result checked against arithmetic: OK" in output, output[-4000:]
    report = json.loads(report_path.read_text())
    assert report["ok"] and not report["failures"], report["failures"]
    assert report["meta"]["deepspeed"] == "left out (--no-deepspeed)", report["meta"]
    assert {(e["dtype"], e["bytes"]) for e in report["results"]} == {
        (d, b) for d in ("float32", "bfloat16") for b in (8, 64 << 10)}, report["results"]
    for e in report["results"]:
        assert set(e["series"]) == {f"{s}|{m}" for s in ("rustc10d", "rustc10d-op", "all_reducer", "gloo")
                                    for m in ("back_to_back", "after_idle")}
        for key, cell in e["series"].items():
            assert cell["ops"] == 20 and 0 < cell["median_us"] <= cell["p90_us"], (e["dtype"], e["bytes"], key, cell)
    assert 0 <= report["idle_cpu_fraction"]["2"] < 1, report["idle_cpu_fraction"]
