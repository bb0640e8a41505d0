"""One rank of tests/test_init.py::test_group_recreated_in_the_same_process: destroy the default
group and create it again, three times, under one torchrun (so over the same Store).

    reinit_job.py BACKEND [--no-import]

--no-import: never `import rustc10d` here; torch must find the backend by its entry point
(tests/test_init.py::test_init_without_import_finds_the_entry_point)."""

import sys
from datetime import timedelta

import torch
import torch.distributed as dist

backend = sys.argv[1] if len(sys.argv) > 1 else "rustc10d"
if backend == "rustc10d" and "--no-import" not in sys.argv:
    import rustc10d  # noqa: F401

for round_ in range(3):
    dist.init_process_group(backend, timeout=timedelta(seconds=20))
    t = torch.full((5,), float(dist.get_rank() + round_))
    dist.all_reduce(t)
    world = dist.get_world_size()
    assert torch.all(t == world * round_ + world * (world - 1) / 2), (round_, t)
    dist.destroy_process_group()
    sys.stdout.write(f"round {round_} ok\n")
sys.stdout.write(f"rustc10d {'was' if 'rustc10d' in sys.modules else 'was not'} imported\n")
