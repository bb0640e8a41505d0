"""The threads of the process that imports this, for the rank scripts that count them
(failure_job.py, threads_job.py)."""

import os


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
