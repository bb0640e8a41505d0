"""One rank of tests/py/groups/test_init.py::test_group_recreated_in_the_same_process: destroy the default
group and create it again, three times, under one torchrun (so over the same Store); on rustc10d,
its direct op on each group, and on each destroyed one (which must raise).

    reinit_job.py BACKEND [--no-import]

--no-import: never `import rustc10d` here; torch must find the backend by its entry point
(tests/py/groups/test_init.py::test_init_without_import_finds_the_entry_point)."""

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
    name = dist.group.WORLD.group_name
    if backend == "rustc10d":
        # The direct op keeps the backend it last ran on; the group made again under the same
        # name is a new one, which it must find, and the destroyed one it must not use.
        u = torch.full((3,), float(dist.get_rank() + 1))
        torch.ops.rustc10d.all_reduce_(u, name, 0)
        assert torch.all(u == world * (world + 1) / 2), (round_, u)
        reduce = sys.modules["rustc10d"].all_reducer()
        assert torch.all(reduce(torch.ones(2)) == world), round_
    dist.destroy_process_group()
    if backend == "rustc10d":
        for how, call in (("the direct op", lambda: torch.ops.rustc10d.all_reduce_(torch.ones(3), name, 0)),
                          ("all_reducer's callable", lambda: reduce(torch.ones(3)))):
            try:
                call()
            except RuntimeError:
                pass
            else:
                raise AssertionError(f"round {round_}: {how} ran on group {name} after it was destroyed")
    sys.stdout.write(f"round {round_} ok\n")
sys.stdout.write(f"rustc10d {'was' if 'rustc10d' in sys.modules else 'was not'} imported\n")
