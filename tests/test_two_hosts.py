"""Two machines for real: two network namespaces joined by a veth pair, each running
`torchrun --nnodes 2` with two ranks, so ranks see different IP addresses exactly as on two
hosts (pitfall 11: works on one machine, fails on two). Needs root and iproute2, as CI has."""

import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid

import pytest

import checks
import harness

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 for network namespaces"
)

SUBNET = "10.213.{}.{}"  # private addresses that exist only inside the namespaces we make


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    """Two namespaces, A (10.213.N.1) and B (10.213.N.2), joined by a veth pair."""
    tag = uuid.uuid4().hex[:6]
    ns = [f"rc10d-a-{tag}", f"rc10d-b-{tag}"]
    veth = [f"rca{tag}", f"rcb{tag}"]
    net = int(tag, 16) % 250
    addrs = [SUBNET.format(net, 1), SUBNET.format(net, 2)]
    try:
        for n in ns:
            ip("netns", "add", n)
        ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for n, v, a in zip(ns, veth, addrs):
            ip("link", "set", v, "netns", n)
            ip("-n", n, "addr", "add", f"{a}/24", "dev", v)
            ip("-n", n, "link", "set", v, "up")
            ip("-n", n, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        pytest.skip(f"cannot create network namespaces here: {e.stderr.decode().strip()}")
    yield ns, addrs
    for n in ns:
        subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=10)


def torchrun_on_both(two_hosts, *args: str) -> dict[str, list[str]]:
    """`torchrun --nnodes 2` of two_hosts_job.py in each namespace, 2 ranks each."""
    (ns_a, ns_b), (addr_a, addr_b) = two_hosts
    port = 29000 + int(uuid.uuid4().int % 2000)
    script = str(harness.REPO / "tests" / "two_hosts_job.py")

    def node(ns: str, addr: str, host: str) -> list[str]:
        return ["ip", "netns", "exec", ns, "env", f"RUSTC10D_TEST_HOST={host}",
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr_a}:{port}", "--rdzv-id", "two-hosts",
                "--rdzv-conf", f"is_host={int(host == 'A')}", "--local-addr", addr, script, *args]

    return {"hostA": node(ns_a, addr_a, "A"), "hostB": node(ns_b, addr_b, "B")}


@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="a rustc10d job")
@pytest.mark.timeout(180)
def test_two_hosts_all_reduce_p2p_and_ddp(two_hosts, tmp_path):
    procs = harness.run_processes(torchrun_on_both(two_hosts), timeout=150, log_dir=tmp_path)
    for proc in procs:
        assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    out = "".join(p.stdout for p in procs)
    for rank, host in [(0, "A"), (1, "A"), (2, "B"), (3, "B")]:
        assert f"rank {rank} on {host} ok" in out, out


@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="a rustc10d job")
@pytest.mark.timeout(180)
def test_partition_fails_both_sides_within_the_timeout(two_hosts, tmp_path):
    """Cut the link between the hosts mid-job: ranks on both sides raise within the group's 5 s
    timeout (plus slack), instead of hanging."""
    (ns_a, _), _ = two_hosts
    result = {}
    runner = threading.Thread(target=lambda: result.update(procs=harness.run_processes(
        torchrun_on_both(two_hosts, "partition"), timeout=150, log_dir=tmp_path)))
    runner.start()
    outputs = [tmp_path / "hostA.out", tmp_path / "hostB.out"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
            p.exists() and p.read_text().count(" ok") == 2 for p in outputs):
        time.sleep(0.2)
    veth = subprocess.run(["ip", "-n", ns_a, "-o", "link", "show", "type", "veth"], capture_output=True,
                          text=True).stdout.split(":")[1].strip().split("@")[0]
    ip("-n", ns_a, "link", "set", veth, "down")
    # Once every rank has raised, mend the link so the torchrun agents can wind up.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sum(p.read_text().count("raised after") for p in outputs) < 4:
        time.sleep(0.2)
    ip("-n", ns_a, "link", "set", veth, "up")
    runner.join()
    out = "".join(p.stdout for p in result["procs"])
    raised = [float(x) for x in re.findall(r"raised after ([\d.]+) s", out)]
    assert len(raised) == 4, out
    assert all(x < 20 for x in raised), raised
