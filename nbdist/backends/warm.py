"""Warm local workers: forked in milliseconds from a fork server that has already imported TensorFlow.

Why: a cold worker's imports (TensorFlow, torch) are most of the wait between running a ``%%dist_train``
cell and its first metric, paid once per worker. So the notebook keeps fork servers (worker/fork_server.py)
that import everything once and fork each worker of each job; loading the extension starts one in the
background. A job takes a server started with the part of its workers' environment that imports may read
(``command.startup_env``: OpenMP reads the thread budget when it loads); the rest goes to each worker with
its job. At most ``KEPT`` servers are kept, the least recently used stopped first. With GPUs a server
imports only what initialises no device (``placement.warm_server_env``), so each worker's GPU is set by its
job first. A run's ``warm_workers=False`` (TrainConfig) turns them off: its workers then start cold.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from ..machine.processes import ChildEnd, ProcessId, oom_killed, remove_quietly, signal_group
from ..wire.handover import READY
from .command import fork_server_command, startup_env

log = logging.getLogger(__name__)

KEPT = 2  # fork servers kept at once (each holds its imported libraries: 0.6-1 GB resident)
FORK_TIMEOUT = 300.0  # seconds for a server to import and fork (a cold start's budget)


class ForkedWorker:
    """A worker forked by a fork server: what ``subprocess.Popen`` offers for it, from its parent's reports.

    The server, not this process, is its parent and reaps it; it reports the end here.
    """

    def __init__(self, pid: int, server: ForkServer) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._id = ProcessId.of(pid)
        self._server = server
        self.end: ChildEnd | None = None  # set by the server's reader thread

    def _ended(self, code: int, peak_rss: int) -> None:
        self.end = ChildEnd(code, peak_rss)
        self.returncode = code

    def poll(self) -> int | None:
        if self.returncode is None and not self._server.alive() and not (self._id and self._id.alive()):
            self._ended(1, 0)  # its server died first and could not report its exit code
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


class ForkServer:
    """The notebook's side of one fork server: its process, its requests, and its workers' ends."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.key = startup_env(env)
        self._awaiting = False  # a request written to the server whose answer was not taken (fork)
        fd, name = tempfile.mkstemp(prefix="fork-server-", suffix=".log", dir=log_dir)
        self.log_path = Path(name)
        # No --die-with-parent: Linux would kill the server when the *thread* that started it ends
        # (a background job's). Its stdin reaches EOF when the kernel dies, and it exits then.
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(fork_server_command(), env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=out, start_new_session=True)
        self._lock = threading.Lock()  # one request at a time, each answered by its pid
        self._forked: list[int | str] = []  # pids forked, or why a request was refused
        self._workers: dict[int, ForkedWorker] = {}
        self._ends: dict[int, tuple[int, int]] = {}  # ends reported before the worker was registered
        self._answered = threading.Condition()
        threading.Thread(target=self._read, name="nbdist-fork-server", daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        """Alive and done importing (it has logged READY)."""
        try:
            with open(self.log_path, "rb") as f:
                return self.alive() and READY.encode() in f.read(1 << 16)
        except OSError:
            return False

    def fork(self, job: dict[str, Any], secret: bytes, log_path: Path, timeout: float = FORK_TIMEOUT) -> ForkedWorker:
        """A new worker with ``job`` (address, rank, its whole environment) logging to ``log_path``.

        Waits while the server imports; raises OSError if it dies or does not answer in ``timeout``.
        """
        request = {"job": job, "secret": secret.hex(), "log": str(log_path)}
        with self._lock:
            try:
                return self._fork_locked(request, timeout)
            except BaseException:
                # Cut between the request and its answer (an interrupt, a timeout): the answer would be paired
                # with the next request, whose run would then hold another run's worker. This server goes; the
                # pool starts a fresh one for the next run.
                if self._awaiting:
                    self.stop()
                raise

    def _fork_locked(self, request: dict[str, Any], timeout: float) -> ForkedWorker:
        self._awaiting = False
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as exc:
            raise OSError(f"the fork server (pid {self.proc.pid}) is gone: {exc}") from exc
        self._awaiting = True  # a request written, its answer not yet taken
        deadline = time.monotonic() + timeout
        with self._answered:
            while not self._forked:
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive():
                    raise OSError(f"the fork server (pid {self.proc.pid}) did not fork a worker; "
                                  f"its log: {self.log_path}")
                self._answered.wait(min(left, 0.5))
            pid = self._forked.pop(0)
            self._awaiting = False
            if isinstance(pid, str):
                raise OSError(f"the fork server (pid {self.proc.pid}) refused a request: {pid}")
            worker = ForkedWorker(pid, self)
            self._workers[pid] = worker
            if pid in self._ends:  # it ended before we registered it
                worker._ended(*self._ends.pop(pid))
        return worker

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                answer = json.loads(line)
            except ValueError:
                log.warning("fork server pid %d: unreadable answer %r", self.proc.pid, line[:200])
                continue
            with self._answered:
                if "forked" in answer:
                    self._forked.append(int(answer["forked"]))
                elif "refused" in answer:
                    self._forked.append(str(answer["refused"]))
                elif "exit" in answer:
                    pid, end = int(answer["exit"]), (int(answer["code"]), int(answer.get("peak_rss", 0)))
                    if pid in self._workers:
                        self._workers.pop(pid)._ended(*end)
                    else:
                        self._ends[pid] = end
                self._answered.notify_all()

    def stop(self) -> None:
        """Stop the server (its running workers keep their jobs; they end with their driver link)."""
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()  # it exits on EOF
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        remove_quietly(self.log_path)


class WarmPool:
    """The kernel's fork servers, by the environment their workers get. Thread-safe."""

    def __init__(self) -> None:
        self._servers: list[ForkServer] = []  # least recently used first
        self._lock = threading.Lock()
        self._dir: Path | None = None

    def server(self, env: dict[str, str]) -> ForkServer:
        """The live fork server for workers started with ``env`` (its startup part), started now if there
        is none. (The caller asks only when its run has warm workers on: TrainConfig.warm_workers.)
        """
        with self._lock:
            stale = [s for s in self._servers if not s.alive()]
            for s in stale:
                self._servers.remove(s)
                s.stop()
            match = next((s for s in self._servers if s.key == startup_env(env)), None)
            if match is None:
                if self._dir is None:
                    self._dir = Path(tempfile.mkdtemp(prefix="nbdist-warm-"))
                match = ForkServer(env, self._dir)
                log.info("starting a fork server for local workers (pid %d) in the background", match.proc.pid)
            else:
                self._servers.remove(match)
            self._servers.append(match)
            old = self._servers[:-KEPT]
            del self._servers[:-KEPT]
        for s in old:
            s.stop()
        return match

    def servers(self) -> list[ForkServer]:
        with self._lock:
            return list(self._servers)

    def close(self) -> None:
        """Stop every fork server (unloading the extension, or the kernel exiting)."""
        with self._lock:
            servers, self._servers = self._servers, []
        for s in servers:
            s.stop()
        with self._lock:
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None


def worker_end(proc: Any, oom_kills_before: int | None) -> ChildEnd | None:
    """How a forked worker ended, with the out-of-memory killer's part judged as ``procs.reap`` does."""
    end = proc.end if proc.poll() is not None else None
    if end is not None:
        end.oom_killed = oom_killed(end.code, oom_kills_before)
    return end


POOL = WarmPool()
atexit.register(POOL.close)
