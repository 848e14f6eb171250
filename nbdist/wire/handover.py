"""How a worker is handed its job: the contract between whoever starts a worker and the worker.

A cold worker gets ``--address``/``--rank`` on its command line; a warm one (backends/warm.py,
spark/warm.py) imports first and then reads ``job_line`` (plus the secret line, wire/secret.py) on
stdin or on its Unix socket. A warm worker logs ``READY`` once its imports are done, and a Spark
executor's warm worker keeps its log beside its socket (``log_path_of``).
"""
from __future__ import annotations

import json
import socket
from pathlib import Path

READY = "warm: ready for a job"  # the line a warm worker logs once its imports are done
IDLE_LIMIT = 3600.0  # seconds a warm worker waits for a job before it gives its memory back


def job_line(address: tuple[str, int], rank: int, env: dict[str, str]) -> bytes:
    """What a warm worker reads on stdin before the secret (``hand_over``): its job, one JSON line."""
    job = {"address": f"{address[0]}:{address[1]}", "rank": rank, "env": env}
    return json.dumps(job).encode() + b"\n"


def log_path_of(sock_path: str) -> Path:
    """The log file of the warm worker listening at ``sock_path`` (same name, ``.log``)."""
    return Path(sock_path).with_suffix(".log")


def read_line(conn: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n") and len(line) < 1024:
        chunk = conn.recv(1)
        if not chunk:
            break
        line += chunk
    return line.strip()
