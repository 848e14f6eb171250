"""A worker's phase report: is it computing or synchronising, and how long it spent in each.

Marking a phase per batch is cheap (two clock reads), but a message per batch would cost
throughput, so the phase is *sampled*: a thread looks at it every ``tick`` seconds and sends
a ``State`` message (wire/reports.py) when the phase changed (at most once per tick) or, unchanged,
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

from ..wire.reports import State

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

    def __init__(self, send: Callable[[State], None], clock: PhaseClock, tick: float = 0.25,
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
        self.send(State(state, **self.clock.timing()))
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


def phase_callbacks(send: Callable[[State], None], collective: Any) -> list[Any]:
    """The phase reporter's callback, if ``collective`` is watched by a ``PhaseClock``."""
    clock = getattr(collective, "clock", None)
    if not isinstance(clock, PhaseClock) or collective.world_size < 2:
        return []
    return [phase_callback(PhaseReporter(send, clock))]


# -- per-phase breakdown of each epoch (benchmarks/epoch_breakdown.py) ------
# The job's TrainSettings.phase_times (TrainConfig.phase_times), set once per job by worker/main.py before it
# trains: the worker then times each epoch's phases and reports them.
_phase_times = False


def time_phases(on: bool) -> None:
    """Set from the job's settings before training: whether ``phase_times_enabled()``."""
    global _phase_times
    _phase_times = bool(on)


def phase_times_enabled() -> bool:
    return _phase_times


class EpochPhases:
    """Where one epoch's wall time goes on a worker, in seconds per phase, one entry per epoch.

    Phases: ``steps`` (train steps, synchronisation inside them excluded), ``sync`` (averaging
    rounds or gradient exchanges: the strategy's timer), ``batch_hooks`` (the rest between two
    steps: other callbacks' batch hooks and Keras' loop), ``epoch_metrics`` (from the last step's
    hooks to validation: Keras reading the metrics), ``validation``, ``ship_weights`` (rank 0
    sending the weights to the driver), ``epoch_end`` (the other epoch-end callbacks: the epoch
    message), ``between_epochs`` (Keras from one epoch's end to the next one's start). Clock
    reads only, and off unless the run's ``phase_times`` is on.
    """

    PHASES = ("steps", "sync", "batch_hooks", "epoch_metrics", "validation", "ship_weights", "epoch_end",
              "between_epochs", "total")

    def __init__(self, strategy_timer: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.timer = strategy_timer
        self.clock = clock
        self.epochs: list[dict[str, float]] = []
        self._cur: dict[str, float] = {}
        self._mark = self._t = self._epoch_start = 0.0
        self._sync0 = self._step_sync0 = self._sync_in_steps = 0.0
        self._prev_end: float | None = None
        self._validated = False

    def _sync(self) -> float:
        return float(self.timer.seconds) if self.timer is not None else 0.0

    # Called by the two callbacks of ``callbacks()``, first and last in the fit's callback list.
    def epoch_begin(self) -> None:
        now = self.clock()
        self._cur = dict.fromkeys(self.PHASES, 0.0)
        if self._prev_end is not None:
            self._cur["between_epochs"] = now - self._prev_end
        self._epoch_start = self._mark = now
        self._sync0, self._sync_in_steps, self._validated = self._sync(), 0.0, False

    def batch_begin(self) -> None:
        now = self.clock()
        self._cur["batch_hooks"] += now - self._mark
        self._t, self._step_sync0 = now, self._sync()

    def batch_end(self) -> None:
        now = self.clock()
        inside = self._sync() - self._step_sync0  # allreduce: the exchange runs inside the step
        self._sync_in_steps += inside
        self._cur["steps"] += now - self._t - inside
        self._mark = now

    def batch_hooks_done(self) -> None:
        now = self.clock()
        self._cur["batch_hooks"] += now - self._mark
        self._mark = now

    def test_begin(self) -> None:
        now = self.clock()
        self._cur["epoch_metrics"] += now - self._mark
        self._mark, self._validated = now, True

    def epoch_end_begin(self) -> None:
        now = self.clock()
        self._cur["validation" if self._validated else "epoch_metrics"] += now - self._mark
        self._t = now

    def shipped(self, seconds: float) -> None:
        self._cur["ship_weights"] += seconds

    def epoch_end_done(self) -> None:
        now = self.clock()
        cur = self._cur
        cur["epoch_end"] = now - self._t - cur["ship_weights"]
        cur["sync"] = self._sync() - self._sync0
        # Averaging rounds (and allreduce's pad steps) run in a batch hook: they count as sync.
        cur["batch_hooks"] = max(0.0, cur["batch_hooks"] - (cur["sync"] - self._sync_in_steps))
        cur["total"] = now - self._epoch_start
        self._prev_end = now
        self.epochs.append(cur)

    def wrap_shipper(self, ship: Callable[[int], None] | None) -> Callable[[int], None] | None:
        if ship is None:
            return None

        def timed(epoch: int) -> None:
            t0 = self.clock()
            ship(epoch)
            self.shipped(self.clock() - t0)

        return timed

    def callbacks(self) -> tuple[Any, Any]:
        """(first, last): put ``first`` before every other callback of the fit and ``last`` after them."""
        import keras

        phases = self

        class First(keras.callbacks.Callback):
            batch_end_in_order = True  # timed on the training thread (callback_list.py)

            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                phases.epoch_begin()

            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                phases.batch_begin()

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                phases.batch_end()

            def on_test_begin(self, logs: Any = None) -> None:
                phases.test_begin()

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                phases.epoch_end_begin()

        class Last(keras.callbacks.Callback):
            batch_end_in_order = True

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                phases.batch_hooks_done()

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                phases.epoch_end_done()

        return First(), Last()
