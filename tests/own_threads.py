"""The threads of the process that imports this, for the rank scripts that count them
(failure_job.py, threads_job.py)."""

import os
import time


def names() -> list[str]:
    """Each thread's name. A thread that ends between the listing of /proc/self/task and the
    read of its name is left out: Python's join() returns before the task leaves /proc (CI once
    lost a rank's RESULT to one)."""
    def name(task: str) -> str | None:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                return f.read().strip()
        except OSError:
            return None
    return [n for n in map(name, os.listdir("/proc/self/task")) if n is not None]


def names_after_joins(prefix: str = "rustc10d", within: float = 2.0) -> list[str]:
    """names(), once threads just joined have left /proc. pthread_join returns when a thread
    clears its tid, while the kernel is still tearing the task down: right after
    destroy_process_group() an engine or I/O thread was seen there, running, in about one run
    of five, gone 200 ms later (the suite once failed on it). Waits at most `within` seconds
    for no thread whose name starts with `prefix`, so one that really stays is still listed."""
    deadline = time.monotonic() + within
    while any(n.startswith(prefix) for n in names()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return names()
