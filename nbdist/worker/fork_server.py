"""The fork server: one process that imports what training needs once, then forks each worker.

The notebook keeps one per worker environment (backends/warm.py); a job's local workers are forked from it
in milliseconds and share its imported libraries' memory until they write to it. Forking is safe because the
server never runs TensorFlow, torch or a thread of its own: it only imports them and waits in a one-threaded
loop. Requests come on its stdin, a pipe only the notebook holds, one JSON line each (a worker's job and the
run's secret: never a command line or the environment); answers go to the descriptor given by
``--fork-server``: ``forked`` with the worker's pid, then ``exit`` with its wait status and peak RSS (only
the server, its parent, can reap it). It exits when its stdin closes or after ``IDLE_LIMIT`` seconds with no
request and no worker.
"""
from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..wire.handover import IDLE_LIMIT

log = logging.getLogger("nbdist.worker")


class _Lines:
    """Complete lines read from a file descriptor without blocking on a partial one."""

    def __init__(self, fd: int) -> None:
        self.fd, self.pending, self.eof = fd, b"", False

    def read(self) -> list[bytes]:
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            self.eof = True
            return []
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        if len(self.pending) > 1 << 20:  # nobody sends a megabyte without a newline
            raise ValueError("request line too long")
        return lines


Work = Callable[[bytes, bytes], int]  # (job line, secret) -> exit code: what a worker does (worker/main.py)


def serve(answer_fd: int, work: Work) -> int:
    """Fork a worker doing ``work`` for each request on stdin until it closes; report each worker's
    pid and end."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to the wakeup pipe
    requests = _Lines(0)
    children: set[int] = set()
    idle_since = time.monotonic()
    while not requests.eof:
        ready, _, _ = select.select([0, wake_r], [], [], 5.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        _report_ends(children, answer_fd)
        if 0 in ready:
            for line in requests.read():
                if not line.strip():
                    continue
                try:
                    request = _request(line)
                except ValueError as exc:
                    log.error("refused a request: %s", exc)
                    _answer(answer_fd, {"refused": str(exc)})
                    continue
                pid = _fork_worker(request, work, answer_fd, (wake_r, wake_w))
                children.add(pid)
                _answer(answer_fd, {"forked": pid})
            idle_since = time.monotonic()
        if children:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > IDLE_LIMIT:
            log.info("no job for %.0f s; the fork server exits", IDLE_LIMIT)
            break
    log.info("fork server done (%s)", "its notebook went away" if requests.eof else "idle")
    return 0


def _answer(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, json.dumps(message).encode() + b"\n")


def _report_ends(children: set[int], answer_fd: int) -> None:
    while children:
        try:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _answer(answer_fd, {"exit": pid, "code": os.waitstatus_to_exitcode(status),
                            "peak_rss": usage.ru_maxrss * 1024})


def _wait_own_group(pid: int, timeout: float = 5.0) -> None:
    """Until the new worker leads its own process group: the notebook signals that group as soon as
    it hears the pid, and a signal sent before the child's setsid() would miss it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.getpgid(pid) == pid:
                return
        except ProcessLookupError:  # it died already: its end is reported as any other
            return
        time.sleep(0.0002)
    log.warning("forked worker %d did not lead its own process group within %.0f s", pid, timeout)


def _request(line: bytes) -> dict[str, Any]:
    """A request checked before anything is forked for it (ValueError: it is not one from nbdist)."""
    try:
        request = json.loads(line)
        job, secret, log_path = request["job"], bytes.fromhex(request["secret"]), str(request["log"])
        ok = isinstance(job, dict) and {"address", "rank"} <= job.keys() and secret and log_path
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"malformed request ({type(exc).__name__}); a fork server is started by nbdist") from exc
    if not ok:
        raise ValueError("malformed request; a fork server is started by nbdist")
    return request


def _fork_worker(request: dict[str, Any], work: Work, answer_fd: int, wake: tuple[int, int]) -> int:
    pid = os.fork()
    if pid:
        _wait_own_group(pid)
        return pid
    code = 1
    try:  # the child: from here on it is a worker like any other, and never returns to the loop
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in (answer_fd, *wake):
            os.close(fd)
        os.setsid()  # its own process group: the notebook stops it and its children together
        code = _run_worker(request, work)
    except BaseException:
        try:
            log.error("forked worker failed:\n%s", traceback.format_exc())
        except BaseException:
            pass
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    raise AssertionError("unreachable")


def _run_worker(request: dict[str, Any], work: Work) -> int:
    """The job of one forked worker: its log, its environment, then the worker's own work."""
    log_fd = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(null)
    os.close(log_fd)
    import numpy as np

    np.random.seed()  # every worker its own global NumPy state, as a process started afresh has
    if request["job"].get("env"):  # it replaces the server's (they agree on what imports read)
        os.environ.clear()
    log.info("forked from the fork server as worker %s of a job", request["job"]["rank"])
    return work(json.dumps(request["job"]).encode(), bytes.fromhex(request["secret"]))
