"""A run's watch over its workers: which one ended, hung, never connected or stayed silent, and the
failure that says so (with the worker's own traceback). A part of ``Run`` (driver/run.py), kept apart so
that run.py holds the run's life cycle; it reads the run's worker handles and coordinator."""
from __future__ import annotations

import queue
import time
from typing import Any

from ..backends import WorkerHandle
from ..wire import protocol
from .failures import describe_exit, last_traceback, likely_causes_first, raised
from .state import TERMINAL

# How long after a worker's connection drops we wait for its process to report an exit code.
EXIT_GRACE = 2.0


class HealthChecks:
    """``Run``'s health checks (the attributes they read are set by ``Run``)."""

    _handles: list[Any]
    _done: set[int]
    _closing: dict[int, float]
    _exited: dict[int, float]
    _left: set[int]  # workers an elastic run went on without (driver/membership.py): no more watched
    _silent: dict[int, float]  # workers silent past heartbeat_timeout: for how long
    _awaiting_cause: bool  # in ``_cause_reported``: another symptom meanwhile is passed over
    _coordinator: Any
    _backend: Any
    _launched_at: float
    config: Any
    world_size: int
    status: str
    _fail: Any  # Run's methods the checks end with, or read through
    _handle: Any
    _holding: Any
    _name: Any

    def _dead_peer(self, rank: int, wait: float = 1.0) -> WorkerHandle | None:
        """Another worker that died (its exit may be reported a moment after the error it caused)."""
        deadline = time.monotonic() + wait
        while True:
            for h in self._handles:
                code = h.exit_status()
                # Exit code 1: that worker raised and reported its own error; it is not the cause.
                lost = getattr(h, "lost", False)  # a lost Spark task's worker: the job's failure set its code 1
                if h.rank != rank and h.rank not in self._done and h.rank not in self._left and code is not None \
                        and (code not in (0, 1) or lost):
                    return h
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _cause_reported(self, wait: float = 2.0) -> bool:
        """After a worker's error that is a peer's symptom (``peer_symptom``): the run's events handled for up to
        ``wait`` s, so that the peer's own error, sent a moment later, ends the run as its cause; whether one did."""
        self._awaiting_cause = True
        deadline = time.monotonic() + wait
        try:
            while self.status not in TERMINAL and time.monotonic() < deadline:
                try:
                    event = self._coordinator.events.get(timeout=0.05)
                except queue.Empty:
                    continue
                self._handle(event)
        finally:
            self._awaiting_cause = False
        return self.status in TERMINAL

    def _check_health(self) -> None:
        now = time.monotonic()
        for h in likely_causes_first(self._handles):
            if h.rank in self._done or h.rank in self._left:
                continue
            code = h.exit_status()
            closing = self._closing.get(h.rank)
            if code is not None and code != 0 or (code is None and closing and now - closing > EXIT_GRACE):
                self._drain_errors()
                if self.status in TERMINAL:
                    return
                how = describe_exit(code, h) if code is not None else "closed its connection"
                if code == protocol.EXIT_UNREACHABLE:  # it never connected: where it tried, and what to change
                    host, port = self._coordinator.address
                    hint = self._backend.unreachable_hint
                    self._fail(h.rank, f"{h.describe()} cannot reach the notebook's coordinator at {host}:{port}"
                                       + (f"; {hint}." if hint else "."), h.log_tail(30))
                    return
                tb = last_traceback(h.log_tail(400))
                self._fail(h.rank, f"{h.describe()} {how} during training{raised(tb)}", tb)
                return
            if code == 0 and h.rank not in self._done:
                self._drain_errors()
                if self.status in TERMINAL or h.rank in self._done:
                    return
                # A worker sends "done" and exits: its last messages may still be on their way through the
                # coordinator's reader, which reports the closed connection only after them.
                exited = self._exited.setdefault(h.rank, now)
                if h.rank not in self._closing and now - exited < EXIT_GRACE:
                    continue
                self._fail(h.rank, f"{h.describe()} exited before finishing", last_traceback(h.log_tail(400)))
                return
        connected = self._coordinator.connected() | self._done | set(self._closing)
        missing = sorted(set(range(max(len(self._handles), self.world_size))) - self._left - connected)
        if missing and now - self._launched_at > self.config.startup_timeout:
            h = self._handles[missing[0]]
            self._fail(missing[0], f"{h.describe()} did not connect within {self.config.startup_timeout:.0f} s",
                       h.log_tail(30))
            return
        for rank in self._coordinator.connected() - self._left - self._done:
            silent = self._coordinator.silent_for(rank)
            if silent > self.config.heartbeat_timeout:
                self._silent[rank] = silent  # an elastic run goes on without it (training.py _process_gone)
                self._fail(rank, f"{self._name(rank)} sent nothing for {self.config.heartbeat_timeout:.0f} s "
                                 "and is presumed hung", self._handles[rank].log_tail(30))
                return

    def _drain_errors(self) -> None:
        """A worker that raised sends its traceback before exiting: prefer that to the exit code."""
        while True:
            try:
                event = self._coordinator.events.get_nowait()
            except queue.Empty:
                return
            self._handle(event)
            if self.status in TERMINAL or self._holding():
                return
