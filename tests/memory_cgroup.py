"""A memory limit on real worker processes: a cgroup v1 memory group (skips where none is writable)."""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import pytest

CGROUP_ROOT = "/sys/fs/cgroup/memory"


@contextlib.contextmanager
def memory_cgroup(limit: int) -> Iterator[str]:
    """A memory group capped at ``limit`` bytes (what a process allocates once in it counts); removed after."""
    path = os.path.join(CGROUP_ROOT, f"nbdist-test-{os.getpid()}-{time.monotonic_ns()}")
    try:
        os.mkdir(path)
        with open(os.path.join(path, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit))
    except OSError as exc:
        pytest.skip(f"no writable cgroup v1 memory controller here ({exc})")
    try:
        yield path
    finally:
        deadline = time.monotonic() + 30
        while True:
            try:
                os.rmdir(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)


def join(cgroup: str, pid: int) -> None:
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(pid))


def peak_usage(cgroup: str) -> int:
    with open(os.path.join(cgroup, "memory.max_usage_in_bytes")) as f:
        return int(f.read())
