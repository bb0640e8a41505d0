"""Failures become clear exceptions, quickly, on every rank: a rank killed mid-collective,
injected faults (RUSTC10D_FAULT), a timeout, mismatched calls; and destroy_process_group()
cleans up. Each scenario is a small job of its own (tests/py/failures/failure_job.py)."""

import json
import os
import re
from pathlib import Path

import pytest

import checks
import harness
import rustc10d

pytestmark = [pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d's failure handling"),
              pytest.mark.timeout(120)]

SCRIPT = Path(__file__).with_name("failure_job.py")


class Reported(dict):
    """rank -> RESULT; asking for a rank that reported none fails with what became of it."""

    def __init__(self, procs):
        super().__init__()
        self.procs = procs

    def __missing__(self, rank):
        raise AssertionError(f"rank {rank} reported no RESULT: {self.procs[rank].describe()}")


def run(scenario: str, world: int, tmp_path, env=None) -> dict[int, dict]:
    """rank -> its RESULT, for the ranks that reported one."""
    procs = harness.launch_ranks(world, [scenario], timeout=90, log_dir=tmp_path, script=SCRIPT,
                                 env=harness.worker_env(env))
    results = Reported(procs)
    for rank, proc in enumerate(procs):
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                results[rank] = json.loads(line[len("RESULT "):])
        assert proc.returncode is not None, f"rank {rank} hung: {proc.describe()}"
    return results, procs


def shm_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.parametrize("scenario", ["sigkill", "sigkill_small"])
@pytest.mark.parametrize("transport", harness.TRANSPORTS)
def test_killed_rank_fails_every_other_rank_fast_and_names_it(tmp_path, transport, scenario):
    """4 MiB (over shared memory: single copy, the call checked in the arena) and 4 KB
    (the arena's all_reduce: everyone waits on its counter, and none may go on waiting)."""
    before = shm_files()
    results, procs = run(scenario, 4, tmp_path, {"RUSTC10D_TRANSPORT": transport})
    assert procs[3].returncode == -9
    assert shm_files() <= before, f"left in /dev/shm: {shm_files() - before}"
    for rank in range(3):
        r = results.get(rank)
        assert r, f"rank {rank} reported nothing: {procs[rank].describe()}"
        first, later = r["first"], r["later"]
        assert first["raised"] and first["seconds"] < (1 if scenario == "sigkill_small" else 10), first
        # Rank 1 is no neighbour of rank 3: it learns of it through the others.
        assert "rank 3" in first["error"], f"rank {rank}: {first['error']}"
        assert later["raised"] and later["seconds"] < 1 and "broken" in later["error"], later


def test_a_staged_op_that_fails_midway_leaves_the_tensor_as_it_was(tmp_path):
    env = {"RUSTC10D_TEST_STAGING": "1", "RUSTC10D_STAGE_PIECE_BYTES": str(1 << 20)}
    results, procs = run("staged_killed", 3, tmp_path, env)
    assert procs[2].returncode == -9
    for rank in range(2):
        r = results[rank]
        assert r["first"]["raised"] and r["first"]["seconds"] < 10, (rank, r)
        assert r["untouched"], f"rank {rank}'s tensor was changed"


STAGED = {"RUSTC10D_TEST_STAGING": "1"}


def test_a_staged_receive_that_fails_midway_leaves_the_tensor_as_it_was(tmp_path):
    results, procs = run("staged_recv_killed", 2, tmp_path, STAGED)
    assert procs[1].returncode == -9
    r = results[0]
    assert r["first"]["raised"] and r["first"]["seconds"] < 10, r
    assert r["untouched"], "the failed receive changed its tensor"
    assert r["later_raised"] and r["later_untouched"], r


def test_a_dropped_receive_holds_stream_ordered_ops_only_until_its_timeout(tmp_path):
    results, procs = run("staged_dropped_recv_expires", 2, tmp_path, STAGED)
    r = results[0]
    assert 2 < r["seconds"] < 10 and r["completed"], r
    assert r["sum"] == 2.0, r
    assert results[1]["sum"] == 2.0 and results[1]["seconds"] < 2, results[1]


def test_destroy_ends_a_stream_ordered_receive_still_posted(tmp_path):
    results, procs = run("staged_destroy_with_recv_pending", 2, tmp_path, STAGED)
    r = results[0]
    assert r["destroy_seconds"] < 10, r
    assert r["completed"] and not r["success"] and r["wait"]["raised"], r
    assert "shut down" in r["wait"]["error"], r
    assert r["untouched"], r


def test_injected_failure_fails_all_ranks(tmp_path):
    results, procs = run("injected", 3, tmp_path, {"RUSTC10D_FAULT": "rank=1,op=allreduce,seq=2,action=fail"})
    for rank in range(3):
        first = results[rank]["first"]
        assert first["raised"] and first["seconds"] < 10, (rank, first)
    assert "RUSTC10D_FAULT" in results[1]["first"]["error"]


@pytest.mark.parametrize("transport", harness.TRANSPORTS)
def test_injected_connection_drop_fails_all_ranks(tmp_path, transport):
    env = {"RUSTC10D_FAULT": "rank=0,op=allreduce,seq=1,action=drop", "RUSTC10D_TRANSPORT": transport}
    results, procs = run("dropped", 3, tmp_path, env)
    for rank in range(3):
        first = results[rank]["first"]
        assert first["raised"] and first["seconds"] < 10, (rank, first)
    assert "RUSTC10D_FAULT" in " ".join(results[r]["first"]["error"] for r in range(3))


def test_recv_times_out_naming_op_seq_and_peer(tmp_path):
    results, procs = run("recv_times_out", 2, tmp_path)
    first = results[0]["first"]
    assert first["raised"] and 1.5 < first["seconds"] < 5, first
    pattern = r"rustc10d: Timed out after 2000 ms: recv #0 from rank 1 \(.*\) \(tag 5\) on rank 0 was waiting for data"
    assert re.search(pattern, first["error"]), first["error"]


def test_stalled_rank_times_out_the_others_naming_op_and_peer(tmp_path):
    results, procs = run("stall_times_out", 2, tmp_path,
                         {"RUSTC10D_FAULT": "rank=0,op=broadcast,action=stall,secs=6"})
    first = results[1]["first"]
    assert first["raised"] and 1.5 < first["seconds"] < 6, first
    # Over shared memory the broadcast waits in the arena; over TCP for the root's data.
    pattern = r"rustc10d: Timed out after 2000 ms: broadcast #0 on rank 1 was waiting (for data from|in the shared arena for) rank 0 \("
    assert re.search(pattern, first["error"]), first["error"]
    if results[1]["error_type"] is not None:  # torch's Python asks getError
        assert results[1]["error_type"] == "TIMEOUT", results[1]


def test_mismatched_calls_are_reported_not_reduced(tmp_path):
    results, procs = run("mismatch", 3, tmp_path)
    for rank in range(3):
        r = results[rank]
        assert r["first"]["raised"] and r["first"]["seconds"] < 10, (rank, r)
        assert r["untouched"], f"rank {rank}'s tensor was changed"
    told = [results[r]["first"]["error"] for r in range(3) if "does not match" in results[r]["first"]["error"]]
    assert told and "torch.int32" in told[0] and "torch.float32" in told[0], told


@pytest.mark.parametrize("transport", harness.TRANSPORTS)
def test_a_failure_of_the_default_group_spares_the_groups_on_its_connections(tmp_path, transport):
    results, procs = run("world_failure_spares_groups", 4, tmp_path, {"RUSTC10D_TRANSPORT": transport})
    for rank in range(4):
        r = results[rank]
        assert r["first"]["raised"] and r["first"]["seconds"] < 10, (rank, r)
        for later in ("again", "send"):
            assert r[later]["raised"] and "broken by an earlier failure" in r[later]["error"], (rank, later, r)
        assert r["sibling_sum"] == 0 + 1 + 2 + 3 and r["later_sum"] == 4 and r["own_sum"] == 4, (rank, r)
    assert any("does not match" in results[r]["first"]["error"] for r in range(4)), results


@pytest.mark.parametrize("transport", harness.TRANSPORTS)
def test_a_late_mismatch_far_from_a_rank_leaves_every_tensor_alone(tmp_path, transport):
    # W=5 over TCP: ranks 1-3 called as their neighbours did (the ring's check alone let them
    # start); over shared memory the arena checks every call.
    results, procs = run("late_mismatch", 5, tmp_path, {"RUSTC10D_TRANSPORT": transport})
    for rank in range(5):
        r = results[rank]
        assert r["first"]["raised"] and r["first"]["seconds"] < 10, (rank, r)
        assert "does not match" in r["first"]["error"], (rank, r["first"]["error"])
        assert r["untouched"], f"rank {rank}'s tensor was changed"


@pytest.mark.parametrize("transport", harness.TRANSPORTS)
def test_destroy_leaves_nothing_behind_and_releases_waiters(tmp_path, transport):
    results, procs = run("destroy_cleans_up", 2, tmp_path, {"RUSTC10D_TRANSPORT": transport})
    for rank in range(2):
        cycles = results[rank]["cycles"]
        # While the group lives, one segment with the peer (two if both dialled); none after.
        assert all(c["mapped_during"] >= (transport == "shm") and c["mapped_after"] == 0 for c in cycles), cycles
        assert all(c["threads"] == 0 for c in cycles), cycles
        assert cycles[1]["sockets"] <= cycles[0]["sockets"], cycles
        assert all(c["destroy_seconds"] < 3 for c in cycles), cycles
    for c in results[0]["cycles"]:
        assert c["waiter"].get("raised") and c["waiter"]["seconds"] < 3, c["waiter"]


def test_ranks_with_different_shared_settings_all_fail_init_naming_it(tmp_path):
    results, procs = run("settings_differ", 3, tmp_path)
    for rank in range(3):
        first = results[rank]["first"]
        assert first["raised"] and first["seconds"] < 10, (rank, first)
        assert first["error"].startswith("ValueError: rustc10d: rank "), first["error"]
        assert "disagree on segment_bytes (RUSTC10D_SEGMENT_BYTES)" in first["error"], first["error"]
        assert "65536 on rank 1" in first["error"] or "65536 on rank" in first["error"], first["error"]


def test_a_rank_hosting_the_store_stays_until_every_rank_has_read_why_init_failed(tmp_path):
    results, procs = run("settings_differ_store_in_rank_0", 3, tmp_path)
    for rank in range(3):
        first = results[rank]["first"]
        assert first["raised"] and first["seconds"] < 10, (rank, first)
        assert "disagree on segment_bytes (RUSTC10D_SEGMENT_BYTES)" in first["error"], (rank, first["error"])


def test_a_bad_setting_fails_its_rank_and_the_others_at_once(tmp_path):
    results, procs = run("bad_setting", 3, tmp_path)
    bad = results[1]["first"]
    assert bad["raised"], bad
    assert bad["error"] == (
        'ValueError: rustc10d: rustc10d.Options(nsocks="0"): expected auto or a number from 1 to 16'
    ), bad["error"]
    for rank in (0, 2):
        first = results[rank]["first"]
        assert first["raised"] and first["seconds"] < 10, (rank, first)
        assert "rank 1 could not join the group: rustc10d: rustc10d.Options(nsocks=" in first["error"], first


def test_a_rank_that_cannot_start_a_thread_raises_and_tells_the_others(tmp_path):
    results, procs = run("no_threads", 3, tmp_path)
    assert all("panicked" not in p.stderr for p in procs), [p.describe() for p in procs]
    failed = results[1]["first"]
    assert failed["raised"] and failed["error"].startswith(
        "DistBackendError: rustc10d: could not start the I/O thread: Resource temporarily unavailable"), failed
    for rank in (0, 2):
        first = results[rank]["first"]
        # within the init timeout of 30 s: told by rank 1, not waiting for it
        assert first["raised"] and first["seconds"] < 10, (rank, first)
        assert "rank 1 could not join the group: rustc10d: could not start the I/O thread" in first["error"], first


def test_each_kind_of_failure_raises_the_exception_torch_would(tmp_path):
    results, procs = run("error_kinds", 2, tmp_path)
    r = results[0]
    want = {
        "bad input": "RuntimeError: rustc10d: broadcast: root rank 7 is out of range",
        "unsupported": "NotImplementedError: rustc10d does not support ReduceOp.BAND on torch.float32 tensors",
        "timeout": "DistBackendError: rustc10d: Timed out after 2000 ms: recv #0 from rank 1",
        "peer lost": "DistNetworkError: rustc10d: recv #1 from rank 1",
    }
    for kind, start in want.items():
        assert r[kind]["raised"] and r[kind]["error"].startswith(start), (kind, r[kind])


def test_options_set_each_groups_settings(tmp_path):
    results, procs = run("options_apply", 2, tmp_path)
    for rank in range(2):
        r = results[rank]
        peer = str(1 - rank)  # JSON keys are strings
        assert r["world_links"] == {peer: "tcp"} and r["group_links"] == {peer: "shm"}, r
        assert r["sum"] == [4.0] * 4, r
        assert r["wrong"]["error"] == "TypeError: rustc10d: pg_options must be rustc10d.Options, got object", r


@pytest.mark.skipif(not rustc10d.TORCH_FEATURES.get("abort_hooks") or not rustc10d.TORCH_FEATURES.get("get_error"),
                    reason="this torch has no abort hooks or getError (README: supported versions)")
def test_abort_hooks_run_at_an_abort_and_get_error_says_what_broke_the_group(tmp_path):
    dumps = tmp_path / "flight_recorder_"
    results, procs = run("abort_hooks", 3, tmp_path, {"TORCH_FR_DUMP_TEMP_FILE": str(dumps)})
    assert procs[2].returncode == -9
    for rank in range(2):
        r = results[rank]
        assert r["before"] == "SUCCESS", r
        assert r["p2p"]["raised"] and "Timed out" in r["p2p"]["error"], r["p2p"]
        # A receive that timed out leaves the group usable: getError says nothing.
        assert r["after_p2p"] == "SUCCESS", r
        # A failed collective breaks it, quickly: the hooks wait for the abort (torch's flight
        # recorder registers one that writes its trace to disk, ~2 s, which no error waits for).
        assert r["collective"]["raised"] and "rank 2" in r["collective"]["error"], r["collective"]
        assert r["collective"]["seconds"] < 1.5, r["collective"]
        assert r["after_collective"] == "REMOTE_ERROR", r
        assert r["calls_p2p"] == [] and r["calls_collective"] == [], r
        # At the abort: the hook taken back does not run; the one that raises stops no other,
        # and the flight recorder's own wrote its trace.
        assert r["calls_abort"] and set(r["calls_abort"]) == {1}, r
        assert (tmp_path / f"flight_recorder_{rank}").stat().st_size > 0, sorted(os.listdir(tmp_path))
        stderr = procs[rank].stderr
        assert "an abort hook raised" in stderr and "a hook that fails" in stderr, stderr[-2000:]
        # The flight recorder (completion hooks): the barrier and the first all_reduce completed,
        # with their durations; the receive that timed out and the all_reduce that failed never did.
        fr = [(name, state) for name, state, _ in r["flight_recorder"]]
        assert [name for name, _ in fr] == [f"rustc10d:recv {rank}<-{rank + 1}", "rustc10d:barrier",
                                            "rustc10d:all_reduce", "rustc10d:all_reduce"], fr
        assert [state == "completed" for _, state in fr] == [False, True, True, False], fr
        assert all(ms is not None and ms >= 0 for _, state, ms in r["flight_recorder"] if state == "completed"), r
