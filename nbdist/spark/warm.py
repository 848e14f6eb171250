"""Warm workers on Spark executors: the next job's workers import TensorFlow while the notebook idles.

A task's worker is a new process, and its imports are most of a short training call. So when a task's job
is over, it starts one worker with ``--warm-socket`` (``start``); that worker listens on a Unix socket in a
directory only this user can enter (``pool_dir``) before it imports everything, and the next task on the
same executor with the same worker environment (``env_key``) takes it (``claim``): by renaming the socket
(atomic: two tasks never take the same worker), then sending the job line and the run's secret. The task
waits on that connection as on its own child (a task that comes while the worker still imports waits for its
answer, up to ``CLAIM_TIMEOUT``); the worker dies if it drops, exits when the executor is gone
or after ``IDLE_LIMIT`` seconds unused, and unpickles nothing it reads. Not used with GPUs (a worker's
device is chosen before TensorFlow starts) or when the run's ``warm_workers`` is off (TrainConfig). No
third-party import here.
"""
from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import secrets
import select
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..backends.command import STARTUP_KEYS, warm_socket_command
from ..machine.processes import remove_quietly
from ..wire.handover import log_path_of, read_line

log = logging.getLogger(__name__)

CLAIM_TIMEOUT = 120.0  # a worker still importing answers once its imports are done
SUN_PATH_MAX = 107  # bytes of a Unix socket's path (108 with the terminating NUL)
NAME_LENGTH = 1 + 16 + 1 + 12 + 5  # "/<env key>-<token>.sock"
_started: list[subprocess.Popen] = []  # reaped at the next start; orphans go to init if we exit first


def env_key(env: dict[str, str]) -> str:
    """A short name for the worker environment, which a warm worker's socket name begins with."""
    text = json.dumps([sys.executable] + [env.get(k, "") for k in STARTUP_KEYS])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def pool_dir(executor: tuple[int, int], root: str | None = None, fallback_root: str = "/tmp") -> Path | None:
    """This user's warm-worker directory for one executor (pid, start time); None if unsafe.

    Under the executor's temporary directory, or under ``fallback_root`` when that one is too deep
    for a Unix socket's path (YARN's container directories are). Every task of the executor
    makes the same choice, so the one that starts a worker and the one that claims it agree.
    Both levels are created 0700 and must be owned by this user with no access for others:
    whoever can enter the directory can hand a worker a job.
    """
    for top in (root or tempfile.gettempdir(), fallback_root):
        base = Path(top) / f"nbdist-warm-{os.getuid()}"
        path = base / f"{executor[0]}-{executor[1]}"
        if len(str(path)) + NAME_LENGTH <= SUN_PATH_MAX:
            break
    else:
        log.warning("not using warm workers: socket paths under %s would be too long for a Unix socket", path)
        return None
    for d in (base, path):
        try:
            d.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(d)
        except OSError as exc:
            log.debug("no warm workers: %s", exc)
            return None
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
            log.warning("not using warm workers: %s is not a private directory of this user", d)
            return None
    return path


def start(directory: Path, env: dict[str, str], executor: tuple[int, int]) -> subprocess.Popen:
    """Start one warm worker for jobs with environment ``env`` (it listens once imported)."""
    for p in list(_started):
        if p.poll() is not None:
            _started.remove(p)
    sock_path = str(directory / f"{env_key(env)}-{secrets.token_hex(6)}.sock")
    with open(log_path_of(sock_path), "wb") as out:
        proc = subprocess.Popen(
            warm_socket_command(sock_path, executor),
            env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    _started.append(proc)
    return proc


class ClaimedWorker:
    """A warm worker this task took: waited on through its socket as a child through ``wait()``."""

    def __init__(self, conn: socket.socket, pid: int, log_path: Path) -> None:
        self._conn, self.pid, self.log_path = conn, pid, log_path
        self.returncode: int | None = None
        self._buf = b""

    def poll(self) -> int | None:
        self._read(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"warm worker {self.pid}", timeout or 0)
            self._read(1.0 if left is None else min(1.0, left))
        return self.returncode

    def _read(self, timeout: float) -> None:
        if self.returncode is not None or not select.select([self._conn], [], [], timeout)[0]:
            return
        try:
            data = self._conn.recv(4096)
        except OSError:
            data = b""
        self._buf += data
        for line in self._buf.split(b"\n")[:-1]:
            if line.startswith(b"exit "):
                self.returncode = int(line[5:])
        if not data and self.returncode is None:  # gone without a word: killed
            self.returncode = -9
        if self.returncode is not None:
            self._conn.close()


def claim(directory: Path, env: dict[str, str], job: bytes, secret: bytes,
          timeout: float = CLAIM_TIMEOUT) -> ClaimedWorker | None:
    """Take a warm worker started with ``env`` and hand it ``job`` and ``secret``; None if none is left."""
    for sock_path in sorted(glob.glob(str(directory / f"{env_key(env)}-*.sock"))):
        mine = f"{sock_path}.taken-{os.getpid()}"
        try:
            os.rename(sock_path, mine)  # atomic: the one task that renames it owns it
        except OSError:
            continue
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.settimeout(timeout)
            conn.connect(mine)
            conn.sendall(job + secret.hex().encode() + b"\n")
            answer = read_line(conn)
            conn.settimeout(None)
        except OSError as exc:
            log.debug("warm worker at %s did not take the job: %s", sock_path, exc)
            conn.close()
            answer = b""
        finally:
            remove_quietly(mine)
        if answer.startswith(b"pid "):
            return ClaimedWorker(conn, int(answer[4:]), log_path_of(sock_path))
    return None
