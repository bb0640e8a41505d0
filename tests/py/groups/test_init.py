"""Registration, initialisation failures and shutdown."""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import checks
import harness


@pytest.mark.parametrize(("world", "check"), harness.check_params("init"))
def test_registration(jobs, world, check):
    jobs.verify(world, check)


@pytest.mark.parametrize("world", checks.WORLD_SIZES)
def test_job_shuts_down_cleanly(jobs, world):
    """After its checks every rank destroys the process group and exits 0."""
    jobs.get(world).verify_clean_exit()


def _init_failure(proc: harness.Proc) -> tuple[float, str]:
    """(seconds init took, error) from a worker.py init run that must have failed in init."""
    assert proc.returncode is not None, proc.describe()
    found = re.search(r"init failed after ([\d.]+) s: (.*)", proc.stderr, re.S)
    assert proc.returncode == 1 and found, f"expected init to fail: {proc.describe()}"
    return float(found.group(1)), found.group(2)


@pytest.mark.timeout(90)
def test_init_without_peer_fails_in_time(tmp_path):
    """Rank 0 of 2 whose rank 1 never starts: init must raise within its 5 s timeout (plus
    slack), not hang."""
    cmd = [sys.executable, str(harness.WORKER), "init", "--host-store",
           "--rank", "0", "--world", "2", "--timeout", "5"]
    [proc] = harness.run_processes({"rank0": cmd}, timeout=60, log_dir=tmp_path)
    seconds, error = _init_failure(proc)
    # A late peer is normal, so giving up well before the timeout is as wrong as hanging
    # (and an import or setup error fails quickly, too).
    assert 2.5 <= seconds < 20, f"init failed after {seconds} s with a 5 s timeout: {error}"
    expected = {"rustc10d": "rustc10d: Timed out after 5000 ms: rank 0 was waiting for rank 1 to publish its address",
                "gloo": "wait timeout after 5000ms"}[checks.BACKEND]
    assert expected in error, f"error does not say {expected!r}: {error}"


IFNAME_VAR = {"rustc10d": "RUSTC10D_SOCKET_IFNAME", "gloo": "GLOO_SOCKET_IFNAME"}[checks.BACKEND]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ifname", ["doesnotexist0", "lo"])
def test_socket_ifname(tmp_path, ifname):
    """The interface env var is honoured: a missing interface fails init naming it; lo works."""
    procs = harness.launch_ranks(2, ["init", "--timeout", "10"], timeout=60, log_dir=tmp_path,
                                 env=harness.worker_env({IFNAME_VAR: ifname}))
    for proc in procs:
        if ifname == "lo":
            assert proc.returncode == 0, proc.describe()
        else:
            _, error = _init_failure(proc)
            assert ifname in error, f"error does not name {ifname}: {error}"


@pytest.mark.timeout(120)
def test_group_recreated_in_the_same_process(tmp_path):
    """destroy_process_group() then init_process_group() again over the same Store: the new
    group must not pick up the old group's addresses, and rustc10d's direct op, which keeps the
    backend it last ran on, must run on the new group of the same name and refuse the old one."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).with_name("reinit_job.py")), checks.BACKEND]
    [proc] = harness.run_processes({"torchrun": cmd}, timeout=100, log_dir=tmp_path)
    assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    assert proc.stdout.count("round 2 ok") == 2, proc.stdout


@pytest.mark.timeout(180)
@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d's own secret")
def test_a_job_secret(tmp_path):
    """The job's secret end to end, in real processes over a real TCPStore: given to every rank
    in a file, the group made, destroyed and made again under torchrun works; a file other users
    may read fails init on every rank saying how to fix it, without showing the secret; ranks
    given different secrets fail init naming the Store key they could not trust."""
    secret = tmp_path / "secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).with_name("reinit_job.py")), "rustc10d"]
    env = harness.worker_env({"RUSTC10D_SECRET_FILE": str(secret)})
    [proc] = harness.run_processes({"torchrun": cmd}, timeout=100, log_dir=tmp_path / "ok", env=env)
    assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
    assert proc.stdout.count("round 2 ok") == 2, proc.stdout

    secret.chmod(0o644)
    procs = harness.launch_ranks(2, ["init", "--timeout", "10"], timeout=60, log_dir=tmp_path / "mode", env=env)
    for proc in procs:
        _, error = _init_failure(proc)
        assert "RUSTC10D_SECRET_FILE" in error and "chmod 600" in error and "0123456789" not in error, error

    # Each rank its own secret: run_processes takes one environment, so these start here.
    cmds = {}
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    for rank, text in enumerate(["the first rank's secret, long enough", "the second rank's secret, as long"]):
        cmds[f"rank{rank}"] = ([sys.executable, str(harness.WORKER), "init", "--timeout", "10", "--rank", str(rank),
                                "--world", "2", "--store", f"127.0.0.1:{store.port}"],
                               harness.worker_env({"RUSTC10D_SECRET": text}))
    running = {name: subprocess.Popen(cmd, cwd=harness.REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, start_new_session=True)
               for name, (cmd, env) in cmds.items()}
    for name, p in running.items():
        try:
            _, err = p.communicate(timeout=60)
        finally:
            p.kill()
        assert p.returncode == 1 and "was not written with this rank's secret" in err, f"{name}: {err[-2000:]}"
        assert "secret, long enough" not in err and "secret, as long" not in err, f"{name} showed a secret: {err[-2000:]}"
    del store


# torch 2.15 looks backends up by the "torch.distributed.backends" entry point group
# (Backend._ensure_backend_registered); 2.11 does not, and the README says so
# (scripts/torch_matrix.sh reports the releases between).
TORCH_FINDS_ENTRY_POINTS = hasattr(dist.Backend, "_ensure_backend_registered")


@pytest.mark.timeout(120)
@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d's own entry point")
def test_init_without_import_finds_the_entry_point(tmp_path):
    """init_process_group("rustc10d") without `import rustc10d`: the package's entry point
    registers it where torch looks entry points up; where torch does not, init fails with
    torch's own "Unknown backend" error, as the README says (this fails once torch changes)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).with_name("reinit_job.py")), "rustc10d", "--no-import"]
    [proc] = harness.run_processes({"torchrun": cmd}, timeout=100, log_dir=tmp_path)
    if TORCH_FINDS_ENTRY_POINTS:
        assert proc.returncode == 0, proc.describe() + "\nstdout:\n" + proc.stdout
        assert proc.stdout.count("round 2 ok") == 2 and "rustc10d was imported" in proc.stdout, proc.stdout
    else:
        assert proc.returncode != 0 and "Unknown backend" in proc.stderr, proc.describe()


@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d's own build check")
def test_import_under_another_torch_says_how_to_rebuild(tmp_path):
    """rustc10d's torch side is built per torch release (the C++ ABI differs between them):
    under a release it has no build for, `import rustc10d` fails naming the installed torch and
    the releases it supports, with the exact command that rebuilds this install from the
    checkout it was built from. A patch release of a supported one loads its release's build."""
    import torch
    release = ".".join(torch.__version__.split(".")[:2])
    code = "import torch; torch.__version__ = '2.0.0'; import rustc10d"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    last = proc.stderr.strip().splitlines()[-1]
    command = f"{sys.executable} -m pip install --no-build-isolation --force-reinstall --no-deps {harness.REPO}"
    assert proc.returncode != 0 and last.startswith(
        f"ImportError: rustc10d has no build for torch 2.0.0 (release 2.0); this install supports torch {release}. "
    ), proc.stderr
    assert last.endswith(f"(from source: {command})"), last
    code = f"import torch; torch.__version__ = '{release}.9+cpu'; import rustc10d; print(rustc10d.BUILT_FOR_TORCH)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == torch.__version__, proc.stderr


FD_JOB = r"""
import os, resource, sys
from datetime import timedelta
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), hard))
import torch, torch.distributed as dist
import rustc10d
import time
rank, port_file = int(sys.argv[1]), sys.argv[2]
if rank == 0:  # on a port the OS picks, told to rank 1 through a file
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    with open(port_file + ".tmp", "w") as f:
        f.write(str(store.port))
    os.rename(port_file + ".tmp", port_file)
else:
    deadline = time.monotonic() + 30
    while not os.path.exists(port_file) and time.monotonic() < deadline:
        time.sleep(0.01)
    store = dist.TCPStore("127.0.0.1", int(open(port_file).read()), 2, is_master=False,
                          timeout=timedelta(seconds=30))
dist.init_process_group("rustc10d", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=10))
print("limit", *resource.getrlimit(resource.RLIMIT_NOFILE), flush=True)
groups = []
# "own": each group opens connections of its own; "shared": groups share the default group's.
options = rustc10d.Options(share_connections=False) if sys.argv[5] == "own" else None
try:
    for i in range(int(sys.argv[4])):
        groups.append(dist.new_group([0, 1], pg_options=options))
        t = torch.ones(1)
        dist.all_reduce(t, group=groups[-1])
        assert t.item() == 2
    print("groups", len(groups), flush=True)
except Exception as e:
    print("failed after", len(groups), "groups:", e, flush=True)
    os._exit(0)
dist.destroy_process_group()
"""


def _fd_job(tmp_path, soft: int, groups: int, env: dict, wait_s: float = 120, links: str = "own") -> list[str]:
    """Two ranks that lower their soft open-file limit to `soft`, then make `groups` groups,
    with connections of their own or (`links="shared"`) on the default group's: each rank's
    output, the ranks killed if they have not ended after `wait_s`."""
    port_file = tmp_path / f"port-{soft}-{groups}-{len(env)}-{links}"
    procs = [subprocess.Popen([sys.executable, "-c", FD_JOB, str(r), str(port_file), str(soft), str(groups), links],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=harness.worker_env(env), cwd=tmp_path) for r in range(2)]
    deadline = time.monotonic() + wait_s
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(killed)")
    return outs


@pytest.mark.timeout(300)
@pytest.mark.skipif(checks.BACKEND != "rustc10d", reason="rustc10d's own limit handling")
def test_the_open_file_limit_is_raised_and_running_out_names_it(tmp_path):
    """A rank whose soft limit is far below its hard one gets it raised at its first group, so
    many groups with connections of their own fit; with RUSTC10D_RAISE_FD_LIMIT=0 the limit
    stays, and running out of descriptors is said once per listener, naming the limit and how
    to raise it. Groups that share the default group's connections fit in the low limit."""
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard limit here ({hard}) leaves nothing to raise")
    for out in _fd_job(tmp_path, 128, 40, {}):
        assert "groups 40" in out, out
        limit = out.split("limit ", 1)[1].split()
        assert int(limit[0]) == int(limit[1]), f"soft limit not raised to the hard one: {out}"
    # Out of descriptors, a rank's listener takes the connection waiting for it with a spare
    # descriptor and refuses it, naming its limit: the dialler fails at once. Before, the
    # dialler tried again until the new group's timeout (30 minutes) and its peer waited for
    # it as long. Both end within seconds (1-2 s here); they are killed after 60 s. Each says
    # the limit once per listener, not once per turn of the I/O thread (25 million lines in
    # 70 s before).
    outs = _fd_job(tmp_path, 128, 200, {"RUSTC10D_RAISE_FD_LIMIT": "0"}, wait_s=60)
    for out in outs:
        assert "(killed)" not in out, f"a rank out of descriptors left its peer waiting: {out[:3000]}"
        assert "limit 128 " in out, out
        assert "groups 200" not in out, f"200 groups fit in 128 descriptors? {out}"
        assert out.count("Too many open files") <= 3, out[:3000]
    said = [out for out in outs if "RLIMIT_NOFILE: soft 128" in out and "ulimit -n" in out]
    assert said, f"no rank named the limit: {outs}"
    # Groups that share the default group's connections need no descriptors of their own:
    # the 200 groups that did not fit above fit now.
    for out in _fd_job(tmp_path, 128, 200, {"RUSTC10D_RAISE_FD_LIMIT": "0"}, wait_s=60, links="shared"):
        assert "limit 128 " in out and "groups 200" in out, out[:3000]
