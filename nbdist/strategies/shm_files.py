"""The files behind shared-memory segments (shared.py): created sized and private, attached only if they match.

Also the kernel's boot id, which tells whether two workers run on one machine (one kernel).
"""
from __future__ import annotations

import logging
import mmap
import os

from ..machine.processes import remove_quietly

log = logging.getLogger(__name__)


def boot_id() -> str:
    """This kernel's random boot id: the same in every container and namespace of one machine, else different."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _create(path: str, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        log.debug("cannot create %s: %s", path, exc)
        return None
    try:
        # Reserve the pages now: a sparse tmpfs file that cannot grow later kills with SIGBUS.
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError as exc:  # /dev/shm too small for the segment (a container's default 64 MiB)
        log.debug("cannot size %s: %s", path, exc)
        remove_quietly(path)
        return None
    finally:
        os.close(fd)


def _attach(path: str, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # another machine, or another container's /dev/shm
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        return mmap.mmap(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
