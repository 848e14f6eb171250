"""A worker's phase report: is it computing or synchronising, and how long it spent in each.

Marking a phase per batch is cheap (two clock reads), but a message per batch would cost
throughput, so the phase is *sampled*: a thread looks at it every ``tick`` seconds and sends
``{"type": "state", ...}`` when the phase changed (at most once per tick) or, unchanged,
once every ``interval`` seconds. A sync is only reported as "synchronising" once it has
lasted ``min_sync`` seconds: a worker blocked on a slow peer shows up, the few-millisecond
rounds of a healthy run do not make the dashboard flicker. Synchronisation time includes
the round in progress, so a stalled allreduce is visible while it stalls.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger("nbdist.worker")


class PhaseClock:
    """Time inside collective operations (the strategy's own timer plus the round in progress)."""

    def __init__(self, strategy_timer: Any = None, clock: Callable[[], float] = time.perf_counter) -> None:
        # The strategy (WeightedAverager / GradientAllreduce) accumulates finished rounds in .seconds.
        self.strategy_timer = strategy_timer
        self.clock = clock
        self.started = clock()
        self._busy_since: float | None = None
        self._own_seconds = 0.0  # used when there is no strategy timer

    def start(self) -> None:
        self.started = self.clock()

    def enter(self) -> None:
        self._busy_since = self.clock()

    def leave(self) -> None:
        since, self._busy_since = self._busy_since, None
        if since is not None and self.strategy_timer is None:
            self._own_seconds += self.clock() - since

    def busy_for(self) -> float:
        """Seconds the current collective call has been running (0: not in one)."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, self.clock() - since)

    @property
    def seconds(self) -> float:
        """Synchronisation seconds so far, including the round in progress."""
        done = self.strategy_timer.seconds if self.strategy_timer is not None else self._own_seconds
        return done + self.busy_for()

    def timing(self) -> dict[str, float]:
        sync = self.seconds
        total = self.clock() - self.started
        return {"sync_seconds": sync, "compute_seconds": max(0.0, total - sync)}


class PhaseCollective:
    """A collective that tells a ``PhaseClock`` when the worker is inside a collective call."""

    def __init__(self, inner: Any, clock: PhaseClock) -> None:
        self.inner = inner
        self.clock = clock
        self.rank = inner.rank
        self.world_size = inner.world_size

    def allreduce_sum(self, buf: np.ndarray) -> None:
        self.clock.enter()
        try:
            self.inner.allreduce_sum(buf)
        finally:
            self.clock.leave()

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        self.clock.enter()
        try:
            self.inner.broadcast(buf, root)
        finally:
            self.clock.leave()

    def close(self) -> None:
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # anything else the engine offers
        return getattr(self.inner, name)


class PhaseReporter:
    """Samples a ``PhaseClock`` on a thread and sends state messages at a modest rate."""

    def __init__(self, send: Callable[[dict[str, Any]], None], clock: PhaseClock, tick: float = 0.25,
                 interval: float = 1.0, min_sync: float = 0.1) -> None:
        self.send = send
        self.clock = clock
        self.tick = tick
        self.interval = interval
        self.min_sync = min_sync
        self.sent = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_state: str | None = None
        self._last_sent = float("-inf")

    def phase(self) -> str:
        return "synchronising" if self.clock.busy_for() >= self.min_sync else "training"

    def report(self, force: bool = False) -> bool:
        """Send the current phase if it changed or ``interval`` passed; True if a message went."""
        state, now = self.phase(), self.clock.clock()
        if not force and state == self._last_state and now - self._last_sent < self.interval:
            return False
        self.send({"type": "state", "state": state, **self.clock.timing()})
        self._last_state, self._last_sent = state, now
        self.sent += 1
        return True

    def start(self) -> None:
        self.clock.start()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="nbdist-phase", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.tick + 1.0)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.tick):
            try:
                self.report()
            except Exception:  # the link is closing: the driver learns why from elsewhere
                log.debug("phase report failed", exc_info=True)
                return


def phase_callback(reporter: PhaseReporter) -> Any:
    """A Keras callback that runs the reporter for the length of ``fit``."""
    import keras

    class PhaseCallback(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            reporter.start()

        def on_train_end(self, logs: Any = None) -> None:
            reporter.stop()

    return PhaseCallback()


def phase_timer(collective: Any, strategy_timer: Any) -> Any:
    """What the progress callback reads ``.seconds`` from: the phase clock when there is one."""
    clock = getattr(collective, "clock", None)
    if not isinstance(clock, PhaseClock):
        return strategy_timer
    clock.strategy_timer = strategy_timer
    return clock


def phase_callbacks(send: Callable[[dict[str, Any]], None], collective: Any) -> list[Any]:
    """The phase reporter's callback, if ``collective`` is watched by a ``PhaseClock``."""
    clock = getattr(collective, "clock", None)
    if not isinstance(clock, PhaseClock) or collective.world_size < 2:
        return []
    return [phase_callback(PhaseReporter(send, clock))]
