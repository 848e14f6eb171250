"""Warm local workers: processes started ahead of a job that have already imported TensorFlow.

A cold worker spends 6-8 s of CPU importing TensorFlow and torch before it can train, which is
most of the wait between running a ``%%dist_train`` cell and its first metric. Loading the
extension therefore starts the default number of local workers in the background with
``--warm``; each imports everything it will need, says so in its log, and then waits on stdin.
A job whose workers would be started with the same environment takes them instead of starting
new ones, hands each its address and rank and then the run's secret on that pipe (never the
command line or the environment), and a new set is started once the job has ended.

Only the local backend uses them, and not on a machine with GPUs (each worker's device must be
chosen before TensorFlow is imported). ``NBDIST_WARM_WORKERS=0`` turns them off; a number sets
how many are kept.
"""
from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from ..procs import remove_quietly, signal_group
from ..wire.handover import READY
from .command import warm_command

log = logging.getLogger(__name__)

ENV_COUNT = "NBDIST_WARM_WORKERS"


@dataclass
class WarmWorker:
    proc: subprocess.Popen
    log_path: Path
    env: dict[str, str]

    def ready(self) -> bool:
        """Alive, and done importing (it has logged READY)."""
        if self.proc.poll() is not None:
            return False
        try:
            with open(self.log_path, "rb") as f:
                return READY.encode() in f.read(1 << 16)
        except OSError:
            return False


def wanted_count(default: int, environ: dict[str, str] | None = None) -> int:
    """How many warm workers to keep: ``$NBDIST_WARM_WORKERS`` if set (0: none), else ``default``."""
    raw = (os.environ if environ is None else environ).get(ENV_COUNT, "").strip()
    if not raw:
        return default
    try:
        return max(0, int(raw))
    except ValueError:
        log.warning("%s=%r is not a number of workers; keeping %d warm workers", ENV_COUNT, raw, default)
        return default


class WarmPool:
    """The kernel's warm workers. Thread-safe: jobs take from it while it refills in the background."""

    def __init__(self) -> None:
        self._workers: list[WarmWorker] = []
        self._lock = threading.Lock()
        self._dir: Path | None = None
        self.enabled = False
        self.size = 0

    def enable(self, size: int, env: dict[str, str]) -> None:
        """Keep ``size`` warm workers started with ``env`` from now on; start them now."""
        self.enabled, self.size = size > 0, size
        if self.enabled:
            self.fill(env)

    def fill(self, env: dict[str, str]) -> None:
        """Start warm workers until ``size`` of them, started with ``env``, are alive."""
        if not self.enabled:
            return
        with self._lock:
            self._drop(lambda w: w.proc.poll() is not None or w.env != env)
            missing = self.size - len(self._workers)
            for _ in range(missing):
                self._workers.append(self._start(env))
        if missing > 0:
            log.info("starting %d warm worker(s) in the background", missing)

    def take(self, count: int, env: dict[str, str]) -> list[WarmWorker]:
        """Up to ``count`` live warm workers started with exactly ``env``, the ready ones first.

        One still importing is taken too: it is further along than a worker started now.
        """
        with self._lock:
            alive = [w for w in self._workers if w.env == env and w.proc.poll() is None]
            taken = sorted(alive, key=lambda w: not w.ready())[:count]
            self._workers = [w for w in self._workers if w not in taken]
        return taken

    def ready_count(self) -> int:
        with self._lock:
            return sum(w.ready() for w in self._workers)

    def close(self) -> None:
        """Stop every warm worker (unloading the extension, or the kernel exiting)."""
        self.enabled = False
        with self._lock:
            self._drop(lambda w: True)
            if self._dir is not None:
                shutil.rmtree(self._dir, ignore_errors=True)
                self._dir = None

    def _drop(self, which) -> None:
        keep = []
        for w in self._workers:
            if which(w):
                _stop(w)
            else:
                keep.append(w)
        self._workers = keep

    def _start(self, env: dict[str, str]) -> WarmWorker:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="nbdist-warm-"))
        fd, name = tempfile.mkstemp(prefix="worker-", suffix=".log", dir=self._dir)
        # No --die-with-parent: Linux would kill the worker when the *thread* that started it
        # ends (a background job's). While it waits, its stdin reaches EOF if the kernel dies;
        # once in a job, the driver link and its heartbeats end it as they end any worker.
        with os.fdopen(fd, "wb") as out:
            proc = subprocess.Popen(warm_command(), env=env, stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return WarmWorker(proc, Path(name), dict(env))


def _stop(w: WarmWorker) -> None:
    if w.proc.poll() is None:
        signal_group(w.proc.pid, signal.SIGKILL)  # it holds no job: nothing to finish
    try:
        w.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        log.warning("warm worker pid %d did not exit", w.proc.pid)
    if w.proc.stdin is not None:
        w.proc.stdin.close()
    remove_quietly(w.log_path)


POOL = WarmPool()
atexit.register(POOL.close)
