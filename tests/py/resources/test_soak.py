"""A soak: W = 4, thousands of mixed collectives and random point-to-point ops, results checked;
file descriptors and memory must be as stable at the end as after the warm-up."""

import json
import sys
from pathlib import Path

import pytest

import checks
import harness


@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d's resource use")
@pytest.mark.timeout(300)
def test_soak_keeps_fds_and_memory_stable(tmp_path):
    procs = harness.launch_ranks(4, ["--steps", "3000"], timeout=240, log_dir=tmp_path,
                                 script=Path(__file__).with_name("soak_job.py"))
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, proc.describe()
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
        r = json.loads(line[len("RESULT "):])
        assert r["late"]["fds"] <= r["early"]["fds"], (rank, r)
        assert r["late"]["rss_mb"] - r["early"]["rss_mb"] < 64, (rank, r)


@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d's resource use")
@pytest.mark.timeout(600)
def test_group_churn_keeps_what_a_process_holds_bounded(tmp_path):
    """A group made, used and destroyed every step, W = 3, 10,000 steps (every 100th with
    connections of its own), each all_reduce checked (about 20 s here): at the end every rank
    holds the file descriptors, threads and /dev/shm entries it held after the first 1,000
    steps (those the last groups held close a moment after destroy returns), its private memory
    grew by less than 12 MB in one half of the 9,000 steps after them at least (a leak of 3 KB a
    group fails it; it grew 2-8 MB in all, of which rustc10d's count of groups per name is about
    0.6 MB, but for a one-off jump of about 49 MB on one rank in some runs, not traced), and the entries rustc10d keeps about closed groups are
    within their caps (each peer's mailbox remembers the last 1,024 closed groups, the process
    the last 4,096 channel numbers; without the caps they hold one per step). This soak also
    found an op failing now and then when a faster rank destroyed the group at once (the
    arena's abort seen before the stage it had passed)."""
    world, steps = 3, 10000
    procs = harness.launch_ranks(world, ["--steps", str(steps), "--warmup", "1000"], timeout=540, log_dir=tmp_path,
                                 script=Path(__file__).with_name("group_churn_job.py"))
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, proc.describe()
        line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
        r = json.loads(line[len("RESULT "):])
        early, late = r["early"], r["late"]
        for what in ("fds", "threads", "dev_shm"):
            assert late[what] <= early[what], (rank, what, r)
        # A leak per group grows both halves alike; a one-off allocation kept (about 49 MB, one
        # rank in some runs, seen with MALLOC_ARENA_MAX=1 too) grows one of them.
        halves = (r["mid"]["anon_mb"] - early["anon_mb"], late["anon_mb"] - r["mid"]["anon_mb"])
        assert min(halves) < 12, (rank, halves, r)
        kept = late["retained"]
        assert 1024 <= kept["closed"] <= 1024 * (world - 1), (rank, kept)
        assert kept["numbers"] <= 4096 and kept["given_up"] == 0, (rank, kept)


@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d's resource use")
@pytest.mark.timeout(400)
def test_group_churn_with_kills_keeps_what_survivors_hold_bounded(tmp_path):
    """The group churn above with a process killed and replaced now and then (churn_kill_job.py):
    12 generations in which the third process is SIGKILLed half-way (just after making a group of
    all three), a new one started in its place and the survivors reconfigure with it, then a last
    one run whole; 1,500 steps per generation (10,500 in all), each all_reduce checked. Every kill fails the
    survivors' op within 5 s (in the group's arena it waited for the 30 s timeout before), never
    with a wrong value; and from after generation 2 to the end the survivors hold
    no more file descriptors, threads or /dev/shm entries (each time just after a kill), and their private memory grew by less
    than 12 MB in one of the two halves at least (a leak per generation or per group grows both)."""
    import torch.distributed as dist
    if not hasattr(dist, "_reconfigure"):
        pytest.skip("torch before 2.14 has no reconfigure")
    kills = 12
    proc = harness.run_processes(
        {"launcher": [sys.executable, str(Path(__file__).with_name("churn_kill_job.py")), "--launch",
                      "--kills", str(kills), "--timeout", "330", "--log-dir", str(tmp_path)]},
        timeout=360, log_dir=tmp_path)[0]
    assert proc.returncode == 0, proc.describe()
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    assert not r["errors"], r["errors"]
    assert r["killed"] == [-9] * kills, r["killed"]
    assert all(code in (0, -9) for code in r["codes"].values()), r["codes"]
    for survivor in ("0", "1"):
        # A group's ranks in a leased arena learned of a killed member only at their timeout (30 s).
        failed_in = r["reports"][survivor]["failed_in"]
        assert len(failed_in) == kills and max(failed_in) < 5, (survivor, failed_in)
        reports = r["reports"][survivor]["held"]
        early, mid, late = reports["2"], reports[str((2 + kills) // 2)], reports[str(kills - 1)]
        for what in ("fds", "threads", "dev_shm"):
            assert late[what] <= early[what], (survivor, what, reports)
        halves = (mid["anon_mb"] - early["anon_mb"], late["anon_mb"] - mid["anon_mb"])
        assert min(halves) < 12, (survivor, halves, reports)
