"""torchft's own tests of native process groups, run on rustc10d (tests/py/torchft/test_torchft.py runs this):

- reconfigure_test's `_resize_worker`, unchanged: 3 processes init with
  `init_process_group("rustc10d", ..., enable_reconfigure=True)`, re-form as [0, 1, 2], [2, 0],
  [1, 2, 0] through `reconfigure_with_store`, checking rank, size and an all_reduce each time,
  then `abort()` and recover.
- manager_integ_test's `test_ddp_recovery`, native, with sync and async quorum: two replica groups
  (threads of one process) train DDP through the Manager, one fails at step 2 and heals; their
  weights end equal. The test builds its native group as Gloo's (`dist.ProcessGroupGloo(store,
  rank, size, enable_reconfigure=True)` registered as the group's backend); here that
  constructor makes rustc10d's instead, and the check below proves rustc10d's ran.

    python tests/py/torchft/run_torchft_tests.py   # prints "OK" at the end, exits non-zero otherwise
"""

import sys
import types
import unittest
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import rustc10d


def resize_worker(rank: int, port: int) -> None:
    import rustc10d  # noqa: F401  (registers the backend in the spawned process)
    from torchft.reconfigure_test import _resize_worker
    _resize_worker(rank, port, "rustc10d")


made = []


def rustc10d_as_gloo(store, rank, size, timeout=timedelta(seconds=60), enable_reconfigure=False):
    """What manager_integ_test calls dist.ProcessGroupGloo: rustc10d's reconfigurable backend."""
    assert enable_reconfigure
    backend = rustc10d.reconfigurable_group(store, timeout)._get_backend(torch.device("cpu"))
    made.append(backend)
    return backend


def main() -> int:
    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    mp.spawn(resize_worker, args=(store.port,), nprocs=3)
    print("reconfigure_test._resize_worker on rustc10d: passed", flush=True)

    import torchft.manager_integ_test as integ
    # The test module's `dist`, with ProcessGroupGloo making rustc10d's backend instead.
    integ.dist = types.SimpleNamespace(**{k: getattr(dist, k) for k in dir(dist) if not k.startswith("__")})
    integ.dist.ProcessGroupGloo = rustc10d_as_gloo
    suite = unittest.TestSuite(integ.ManagerIntegTest(name) for name in (
        "test_ddp_recovery_2_native_async_quorum", "test_ddp_recovery_3_native_sync_quorum"))
    result = unittest.TextTestRunner(verbosity=2, stream=sys.stdout).run(suite)
    if not result.wasSuccessful():
        return 1
    ours = [b for b in made if type(b).__name__ == "_Backend"]
    if len(ours) < 4:  # two replicas, two tests, each replica's attempts
        print(f"FAILED: the tests made {len(made)} backends, {len(ours)} of them rustc10d's", flush=True)
        return 1
    print(f"manager_integ_test.test_ddp_recovery (native, both quorums) on rustc10d: passed, {len(ours)} groups")
    print("OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
