"""A warm worker on a Spark executor, its side: listen on a private Unix socket, take one task's job.

The task's side (starting such workers, claiming one) is spark/warm.py; the lines they exchange
are in wire/handover.py. Nothing read here is unpickled: one JSON line and one hex line, from a
peer the kernel says is this same user.
"""
from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable

from ..machine.processes import remove_quietly
from ..wire.handover import IDLE_LIMIT, log_path_of, read_line


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel records it."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[2]


_bound: dict[str, socket.socket] = {}  # bound by ``python -m nbdist.worker`` before TensorFlow loads


def bind_early(path: str) -> None:
    """Bind the socket first thing (__main__, before TensorFlow's import): a task of the next job that
    comes while this worker still imports queues for it, rather than starting a cold worker beside it."""
    _bound[path] = listen(path)


def listen(path: str) -> socket.socket:
    """The warm worker's socket, bound before it imports so a task can already queue for it."""
    if path in _bound:
        return _bound.pop(path)
    old = os.umask(0o077)  # the socket file is 0600 (the directory is 0700 already)
    try:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
    finally:
        os.umask(old)
    listener.listen(4)
    return listener


def serve_one(listener: socket.socket, path: str, executor_alive: Callable[[], bool],
              idle_limit: float = IDLE_LIMIT) -> tuple[socket.socket, bytes, bytes] | None:
    """Wait for a task of this user; return (connection, job line, secret line).

    None when the executor is gone or nobody came within ``idle_limit`` seconds; the worker's
    socket and log are then removed, since no task will read them.
    """
    listener.settimeout(1.0)
    started = time.monotonic()
    taken = None
    try:
        while time.monotonic() - started < idle_limit:
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                if not executor_alive():
                    return None
                continue
            if peer_uid(conn) != os.getuid():
                conn.close()
                continue
            conn.settimeout(10.0)
            try:
                job, secret = read_line(conn), read_line(conn)
            except OSError:
                conn.close()
                continue
            conn.settimeout(None)
            taken = conn, job, secret
            return taken
        return None
    finally:
        listener.close()
        remove_quietly(path)  # still there if no task renamed it
        if taken is None:
            remove_quietly(log_path_of(path))
