"""Handing the per-run secret to a worker without exposing it.

A command line is world-readable (``ps``), the environment of a container is shown by
``podman inspect`` / ``docker inspect`` and a process's environment by ``ps e`` to its
owner. So every backend starts the worker with a pipe as its stdin and writes the secret
there as one hex line, then closes the pipe; the worker reads it before anything else.
"""
from __future__ import annotations

import logging
import subprocess

log = logging.getLogger(__name__)


def hand_over(proc: subprocess.Popen, secret: bytes, before: bytes = b"") -> None:
    """Write ``secret`` to a worker's stdin (a pipe) and close it.

    ``before``: lines the worker reads first (a warm worker's job, backends/warm.py).
    """
    if proc.stdin is None:
        raise ValueError("start the worker with stdin=subprocess.PIPE to hand it the secret")
    try:
        proc.stdin.write(before + secret.hex().encode() + b"\n")  # well under a pipe's buffer: never blocks
        proc.stdin.close()
    except OSError as exc:  # it died at once; its exit status tells the job why
        log.debug("could not hand the secret to pid %s: %s", proc.pid, exc)
