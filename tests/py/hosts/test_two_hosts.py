"""Several machines for real: "hosts" of rustc10d.testbed (network namespaces joined by a
bridge, links optionally capped with tc), so ranks on different hosts see different IP
addresses exactly as on separate machines (pitfall 11: works on one machine, fails on two).
Jobs start as users start them: `torchrun --nnodes H` in each host, or plain processes with
RANK/WORLD_SIZE/MASTER_ADDR (env://). Needs root and iproute2, as CI has; skips without."""

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import checks
import harness
from rustc10d import testbed
from rustc10d.testbed import Hosts

# torch_independent: the links between hosts are the core's alone (pytest.ini).
pytestmark = [pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d jobs"), pytest.mark.torch_independent]

TWO_HOSTS_JOB = str(Path(__file__).with_name("two_hosts_job.py"))
HOSTS_JOB = str(Path(__file__).with_name("hosts_job.py"))
PORT = 29400  # free: every test bed is a fresh set of namespaces
LINK_GBIT = 2  # the cap on each link of the capped jobs, each way
CHECKS = 55  # what hosts_job.py counts when every check ran


def torchrun(hosts: Hosts, nproc: int, script: str, *args: str, label=str, env_of=lambda h: {}) -> dict[str, list[str]]:
    """`torchrun --nnodes H --nproc-per-node nproc script args` in every host, host 0 hosting the
    rendezvous; RUSTC10D_TEST_HOST=label(h) and the variables env_of(h) in host h."""
    def node(h: int) -> list[str]:
        env = {"RUSTC10D_TEST_HOST": label(h), **env_of(h)}
        return hosts.command(h, [
            "env", *(f"{k}={v}" for k, v in env.items()), sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(hosts.count), "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{hosts.addrs[0]}:{PORT}", "--rdzv-id", "hosts",
            "--rdzv-conf", f"is_host={int(h == 0)}", "--local-addr", hosts.addrs[h], script, *args])
    return {f"host{label(h)}": node(h) for h in range(hosts.count)}


def plain_ranks(hosts: Hosts, world: int, script: str, *args: str, env_of=lambda h: {}) -> dict[str, list[str]]:
    """Ranks as plain processes (init_method env://), rank r on host r % H (interleaved), with
    the variables env_of(host) besides the usual ones."""
    def rank(r: int) -> list[str]:
        h = r % hosts.count
        env = {"RANK": r, "WORLD_SIZE": world, "LOCAL_RANK": r // hosts.count, "MASTER_ADDR": hosts.addrs[0],
               "MASTER_PORT": PORT, "RUSTC10D_TEST_HOST": h, **env_of(h)}
        return hosts.command(h, ["env", *(f"{k}={v}" for k, v in env.items()), sys.executable, script, *args])
    return {f"rank{r}": rank(r) for r in range(world)}


def assert_all_ok(procs: list[harness.Proc], world: int, hosts_of: list[int]):
    for proc in procs:
        assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    out = "".join(p.stdout for p in procs)
    for rank, host in enumerate(hosts_of):
        assert f"rank {rank} on host {host} ok ({CHECKS} checks" in out, out


@pytest.mark.timeout(180)
def test_two_hosts_all_reduce_p2p_and_ddp(make_hosts, tmp_path):
    hosts = make_hosts(2)
    cmds = torchrun(hosts, 2, TWO_HOSTS_JOB, label="AB".__getitem__)
    procs = harness.run_processes(cmds, timeout=150, log_dir=tmp_path)
    for proc in procs:
        assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    out = "".join(p.stdout for p in procs)
    for rank, host in [(0, "A"), (1, "A"), (2, "B"), (3, "B")]:
        assert f"rank {rank} on {host} ok" in out, out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nhosts, cut", [(2, 0), (3, 2)], ids=["2 hosts, host 0 cut", "3 hosts, host 2 cut"])
def test_partition_fails_every_rank_within_the_timeout(make_hosts, tmp_path, nhosts, cut):
    """Cut one host's link mid-job (2 ranks per host, small all_reduces in a loop): every rank
    raises within the group's 5 s timeout (plus slack) naming a peer, instead of hanging. With
    3 hosts, every rank of the two hosts that still reach each other names a rank of the one cut
    off."""
    hosts = make_hosts(nhosts)
    labels = "ABC"[:nhosts]
    result = {}
    runner = threading.Thread(target=lambda: result.update(procs=harness.run_processes(
        torchrun(hosts, 2, TWO_HOSTS_JOB, "partition", label=labels.__getitem__), timeout=150, log_dir=tmp_path)))
    runner.start()
    outputs = [tmp_path / f"host{label}.out" for label in labels]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(
            p.exists() and p.read_text().count(" ok") == 2 for p in outputs):
        time.sleep(0.2)
    hosts.link_down(cut)
    # Once every rank has raised, mend the link so the torchrun agents can wind up.
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and sum(p.read_text().count("raised after") for p in outputs) < 2 * nhosts:
        time.sleep(0.2)
    hosts.link_up(cut)
    runner.join()
    out = "".join(p.stdout for p in result["procs"])
    raised = {int(r): (float(s), why) for r, s, why in re.findall(r"rank (\d+) raised after ([\d.]+) s: (.*)", out)}
    assert sorted(raised) == list(range(2 * nhosts)), out
    assert all(s < 20 and re.search(r"rank \d", why) for s, why in raised.values()), raised
    if nhosts > 2:
        # Every rank of the hosts still joined names a rank of the lost one: a rank that waited
        # for a joined rank, itself stuck on the lost host, asks it and says what it said.
        lost = (f"rank {2 * cut} ", f"rank {2 * cut + 1} ")
        for rank, (_, why) in raised.items():
            assert rank // 2 == cut or any(n in why for n in lost), (rank, why)


@pytest.mark.timeout(120)
def test_a_killed_rank_fails_every_rank_of_both_hosts_at_once(make_hosts, tmp_path):
    """2 hosts x 2 ranks, ranks alternating (plain processes), small all_reduces in a loop: on
    each host the two ranks meet in their host's arena. Rank 1, which made host 1's arena, is
    SIGKILLed: every other rank raises within seconds (the group's timeout is 30 s), naming it,
    whether it waited in its host's arena or for data from another host."""
    hosts = make_hosts(2)
    procs = harness.run_processes(plain_ranks(hosts, 4, TWO_HOSTS_JOB, "kill"), timeout=90, log_dir=tmp_path)
    out = "".join(p.stdout for p in procs)
    raised = {int(r): (float(s), why) for r, s, why in re.findall(r"rank (\d+) raised after ([\d.]+) s: (.*)", out)}
    assert sorted(raised) == [0, 2, 3], out
    for rank, (took, why) in raised.items():
        assert took < 5 and "rank 1 " in why, (rank, took, why)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nhosts, per_host", [(3, 1), (2, 3)], ids=["3x1", "2x3"])
def test_torchrun_hosts_against_arithmetic(make_hosts, tmp_path, nhosts, per_host):
    """`torchrun --nnodes H --nproc-per-node L` over links capped at LINK_GBIT: every collective
    against arithmetic (tests/py/hosts/hosts_job.py), roots on another host, the same bits everywhere."""
    hosts = make_hosts(nhosts, link_gbit=LINK_GBIT)
    env = harness.worker_env({"GLOO_SOCKET_IFNAME": "rc0"})
    procs = harness.run_processes(torchrun(hosts, per_host, HOSTS_JOB), timeout=150, log_dir=tmp_path, env=env)
    assert_all_ok(procs, nhosts * per_host, [r // per_host for r in range(nhosts * per_host)])


@pytest.mark.timeout(180)
def test_interleaved_ranks_against_arithmetic(make_hosts, tmp_path):
    """Rank r on host r % 2 (2 hosts x 2 ranks), started as plain processes with env://: each
    host's ranks are not a block of consecutive ranks, so no ring neighbour is on the same host."""
    hosts = make_hosts(2, link_gbit=LINK_GBIT)
    procs = harness.run_processes(plain_ranks(hosts, 4, HOSTS_JOB), timeout=150, log_dir=tmp_path)
    assert_all_ok(procs, 4, [r % 2 for r in range(4)])


@pytest.mark.timeout(180)
def test_sealed_frames_between_hosts_against_arithmetic(make_hosts, tmp_path):
    """RUSTC10D_ENCRYPT=1 with the job's secret, rank r on host r % 2 (2 hosts x 2 ranks), links
    capped: every check of hosts_job.py passes with every TCP frame sealed (what sealing hides and
    refuses: tests/rust/security/sealed_frames.rs); without the secret, init fails saying it is needed."""
    hosts = make_hosts(2, link_gbit=LINK_GBIT)
    secret = {"RUSTC10D_ENCRYPT": 1, "RUSTC10D_SECRET": "a job's secret for the test of sealed frames"}
    procs = harness.run_processes(plain_ranks(hosts, 4, HOSTS_JOB, env_of=lambda h: secret), timeout=150,
                                  log_dir=tmp_path)
    assert_all_ok(procs, 4, [r % 2 for r in range(4)])
    procs = harness.run_processes(plain_ranks(hosts, 1, HOSTS_JOB, "init", env_of=lambda h: {"RUSTC10D_ENCRYPT": 1}),
                                  timeout=60, log_dir=tmp_path / "no-secret")
    out = "".join(p.stdout for p in procs)
    assert "init failed" in out and "RUSTC10D_ENCRYPT=1 needs the job's secret" in out, out


@pytest.mark.timeout(120)
def test_hosts_with_different_shared_settings_fail_at_init(make_hosts, tmp_path):
    """Host 1 runs another RUSTC10D_SINGLE_COPY_BYTES (a setting every rank must share): every
    rank, on both hosts, fails init at once (not at the 30 s timeout), naming it."""
    hosts = make_hosts(2)
    cmds = torchrun(hosts, 2, HOSTS_JOB, "init", env_of=lambda h: {"RUSTC10D_SINGLE_COPY_BYTES": 131072} if h else {})
    procs = harness.run_processes(cmds, timeout=90, log_dir=tmp_path)
    out = "".join(p.stdout for p in procs)
    failed = re.findall(r"rank (\d) on host \d: init failed after ([\d.]+) s: (.*)", out)
    assert sorted(rank for rank, _, _ in failed) == ["0", "1", "2", "3"], "\n".join(p.describe() for p in procs) + out
    for rank, seconds, error in failed:
        assert float(seconds) < 15, out
        assert "single_copy_bytes (RUSTC10D_SINGLE_COPY_BYTES)" in error, out
        assert "65536" in error and "131072" in error, out
    for proc in procs:
        assert proc.returncode not in (0, None), proc.describe()


def striping_outcome(procs: list[harness.Proc], lanes: tuple[int, ...]) -> str | None:
    """What is wrong with one run of hosts_job.py striping (None: nothing)."""
    out = "".join(p.stdout for p in procs)
    for proc in procs:
        if proc.returncode != 0:
            return proc.describe() + "\nstdout:\n" + proc.stdout
    found = re.findall(r"rank (\d) on host \d: connections \{(\d): (\d+)\} first ([\d.]+) s last ([\d.]+) s "
                       r"settled (\w+)", out)
    if sorted(rank for rank, *_ in found) != ["0", "1"]:
        return "not every rank said what it chose:\n" + out
    for rank, peer, count, first, last, settled in found:
        if settled != "True":
            return f"rank {rank} never settled:\n" + out
        if int(count) not in lanes:
            return f"rank {rank} chose {count} connections, not one of {lanes}:\n" + out
        # 4x one connection fills the link; where lanes share a bucket of the test bed
        # (CI saw it), those go at half speed and hold the others back: 2x.
        if lanes != (1,) and not float(last) < 0.6 * float(first):
            return f"rank {rank}'s all_reduce went from {first} s to {last} s only:\n" + out
    return None


@pytest.mark.timeout(330)
@pytest.mark.parametrize("caps, lanes", [({"link_gbit": 2, "flow_gbit": 0.5}, (2, 4, 8)), ({"link_gbit": 1}, (1,))],
                         ids=["per-connection-cap", "link-cap"])
def test_connections_are_chosen_by_measured_throughput(make_hosts, tmp_path, caps, lanes):
    """nsocks=auto (the default), 2 hosts x 1 rank, 16 MiB all_reduces against arithmetic, until
    both ranks' counts are final (CI at stop 35 read one mid-measurement). Where each TCP
    connection is capped at a quarter of the link, each rank opens more connections to the
    other, as long as more pay, and the all_reduce gets that much faster: 4 fill the link, 8
    where two of the 4 landed in one of the test bed's hash buckets; a rank stays at 2 where
    4 gained too little to keep (1.15-1.2x 2's rate, as shared buckets make it: 3 runs in 10
    here). Where one connection fills the link, more do not pay and each rank stays at one.

    What is measured is the machine's, and the machine is shared: once (CI at stop 52, both
    cases in one run; not in any run here) connections ran well under their caps for the whole
    measurement (one at 45 MB/s on the 1 Gbit link), and 2 connections did pay there. So a run that misses is
    run once more on the same test bed, and the test fails where both miss, with both runs'
    words and the load average before each."""
    hosts = make_hosts(2, **caps)
    missed = []
    for attempt in range(2):
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
        procs = harness.run_processes(torchrun(hosts, 1, HOSTS_JOB, "striping"), timeout=150,
                                      log_dir=tmp_path / f"run{attempt}")
        wrong = striping_outcome(procs, lanes)
        if wrong is None:
            return
        missed.append(f"run {attempt + 1} (load average before it: {load}): {wrong}")
    pytest.fail("\n".join(missed))


# rustc10d.check, the preflight check of a cluster: on one host, on three hosts with one link
# capped, and with a host cut off.

def check_rows(out: str) -> dict[tuple[int, int], str]:
    """The link table of rustc10d.check's report: {(from, to): its whole row}."""
    return {(int(m[1]), int(m[2])): m[0] for m in re.finditer(r"^\| (\d+) \| (\d+) \| .*$", out, re.M)}


@pytest.mark.timeout(120)
def test_the_preflight_check_reports_every_link_of_a_healthy_host(tmp_path):
    """Three ranks under torchrun on this host: one node, six shared-memory links measured.
    (Whether one is flagged is left alone here: three ranks on two cores copy memory in turns.)"""
    procs = harness.run_processes({"check": [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
        "-m", "rustc10d.check", "--timeout", "10"]}, timeout=90, log_dir=tmp_path)
    out = procs[0].stdout
    assert procs[0].returncode == 0 and procs[0].seconds < 30, procs[0].describe() + out
    assert "3 ranks on 1 node(s)" in out and "FAILED" not in out, out
    rows = check_rows(out)
    assert sorted(rows) == [(a, b) for a in range(3) for b in range(3) if a != b], out
    assert all("| shm |" in row and "Gbit/s" in row for row in rows.values()), out


@pytest.mark.timeout(180)
def test_the_preflight_check_flags_a_capped_link(make_hosts, tmp_path):
    """Three hosts, one rank each; host 2 sends at 0.3 Gbit/s (tc on its side of its link), the
    others at veth speed: its two outgoing links are flagged, slow and asymmetric, and nothing
    else is."""
    hosts = make_hosts(3)
    subprocess.run(hosts.command(2, ["tc", "qdisc", "add", "dev", testbed.IFNAME, "root", "tbf", "rate", "300mbit",
                                     "burst", "65536", "latency", "50ms"]), check=True, timeout=10)
    procs = harness.run_processes(torchrun(hosts, 1, "-m", "rustc10d.check", "--timeout", "15"),
                                  timeout=150, log_dir=tmp_path)
    for proc in procs:
        assert proc.returncode == 0, proc.describe() + proc.stdout
    out = procs[0].stdout
    assert "3 ranks on 3 node(s)" in out, out
    rows = check_rows(out)
    assert len(rows) == 6 and all("| tcp |" in row for row in rows.values()), out
    for link, row in rows.items():
        assert ("SLOW ASYMMETRIC" in row) == (link[0] == 2), out


@pytest.mark.timeout(120)
def test_the_preflight_check_names_a_host_it_cannot_reach(make_hosts, tmp_path):
    """Host 1's link is down: its rank never reaches the Store. Rank 0 (on host 0, serving the
    Store: plain processes) says it sent no report, and fails, within about two timeouts."""
    hosts = make_hosts(2)
    hosts.link_down(1)
    procs = harness.run_processes(plain_ranks(hosts, 2, "-m", "rustc10d.check", "--timeout", "5"),
                                  timeout=100, log_dir=tmp_path)
    out = procs[0].stdout
    assert procs[0].returncode == 1 and procs[0].seconds < 20, procs[0].describe() + out
    assert "NO REPORT from rank(s) [1]" in out and "FAILED" in out, out
