"""What a run looks like from the driver: pure state built from worker events.

Renderers (text, HTML, widgets) read this state; nothing here knows about
IPython, sockets or Keras.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..wire.reports import Epoch, Progress, State

# A run's status once it has ended.
TERMINAL = ("done", "failed", "stopped")
WORKER_STATES = ("starting", "training", "synchronising", "done", "failed", "stopped")


@dataclass
class WorkerProgress:
    rank: int
    state: str = "starting"
    host: str = ""
    pid: int | None = None
    epoch: int = 0
    batch: int = 0
    batches: int = 0
    samples: int = 0  # training samples in this worker's shard
    samples_done: int = 0  # over the whole run
    compute_seconds: float = 0.0
    sync_seconds: float = 0.0
    error: str = ""
    device: str = ""  # where it trains: "GPU 0 (NVIDIA H200)" or "CPU", once the worker said


@dataclass
class MembershipChange:
    """An elastic run's change of workers (driver/membership.py): who left and why, who joined, the generation it
    began, its workers (their launch ranks), the epochs its workers went on from and the steps lost."""

    generation: int
    left: list[int]
    why: str
    workers: list[int]
    committed: int  # epochs done at the commit the workers went on from (a join's: where the members stopped)
    steps_lost: int  # steps run past that commit by the generation that broke (the most any survivor ran)
    at: float = field(default_factory=time.monotonic)
    started: bool = True  # False: the first generation, without workers that did not start in time
    joined: list[int] = field(default_factory=list)  # workers that joined at that commit (late starters, replacements)
    step: int = 0  # steps of epoch ``committed`` (from 0) the commit holds: > 0 for a commit every K steps

    @property
    def line(self) -> str:
        """The change in one line (the text UI's)."""
        who = ", ".join(f"worker {r}" for r in self.left)
        n = f"{len(self.workers)} worker{'' if len(self.workers) == 1 else 's'}"
        if not self.started:
            return f"{who} did not start ({self.why}); training with {n}"
        where = f" and {self.step} step{'' if self.step == 1 else 's'} of the next" if self.step else ""
        came = ", ".join(f"worker {r}" for r in self.joined)
        if not self.left:
            return f"{came} joined at the commit after epoch {self.committed}{where}; training with {n}"
        joined = f" and {came} joined" if self.joined else ""
        return (f"{who} left ({self.why}){joined}; going on with {n} from the commit after "
                f"epoch {self.committed}{where}, {self.steps_lost} step{'' if self.steps_lost == 1 else 's'} lost")


@dataclass
class EpochAggregator:
    """Averages each epoch's metrics over workers, weighted by the samples behind them."""

    world_size: int
    _pending: dict[int, dict[int, dict[str, Any]]] = field(default_factory=dict)

    def add(self, rank: int, epoch: int, report: dict[str, Any]) -> list[dict[str, Any]] | None:
        """Keep one worker's report; return every worker's once the epoch is complete."""
        reports = self._pending.setdefault(epoch, {})
        reports[rank] = report
        if len(reports) < self.world_size:
            return None
        del self._pending[epoch]
        return list(reports.values())

    def without(self, ranks: set[int], world_size: int) -> list[tuple[int, list[dict[str, Any]]]]:
        """Workers ``ranks`` left: their reports are dropped and ``world_size`` are counted from here on;
        returns the epochs that are complete with the reports already in (epoch, reports), oldest first. Under
        allreduce every worker's logs are already the whole step's (fit_sync.py sums the metric state)."""
        self.world_size = world_size
        complete = []
        for epoch in sorted(self._pending):
            reports = {r: v for r, v in self._pending[epoch].items() if r not in ranks}
            self._pending[epoch] = reports
            if len(reports) >= world_size:
                complete.append((epoch, list(reports.values())))
                del self._pending[epoch]
        return complete


def merge_epoch_logs(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """Every worker's logs weighted by the rows behind them; an array result (``F1Score`` per class)
    element-wise, in its own dtype."""
    sums: dict[str, Any] = {}
    weights: dict[str, float] = {}
    dtypes: dict[str, Any] = {}
    for r in reports:
        for key, value in r["logs"].items():
            w = r["val_samples"] if key.startswith("val_") else r["samples"]
            if w <= 0 or value is None:
                continue
            if isinstance(value, np.ndarray):
                dtypes[key] = value.dtype
                value = value.astype(np.float64)
            else:
                value = float(value)
            sums[key] = sums.get(key, 0.0) + value * w
            weights[key] = weights.get(key, 0.0) + w
    return {k: (sums[k] / weights[k]).astype(dtypes[k]) if k in dtypes else sums[k] / weights[k] for k in sums}


@dataclass
class RunState:
    world_size: int
    epochs: int
    backend: str = "local"
    strategy: str = "averaging"
    initial_epoch: int = 0
    status: str = "starting"
    started: float = field(default_factory=time.monotonic)
    first_metric_at: float | None = None
    finished_at: float | None = None
    history: dict[str, list[float]] = field(default_factory=dict)
    epoch_seconds: list[float] = field(default_factory=list)
    epoch_samples: list[int] = field(default_factory=list)
    error: str = ""
    workers: list[WorkerProgress] = field(default_factory=list)
    restarts: int = 0  # times the workers were relaunched from the last checkpoint
    data_note: str = ""  # what was done to the data before the workers started (Spark rebalancing), for the first line
    world_note: str = ""  # why the run has fewer workers than asked (driver/resolve.py resolve_world), if it has
    min_workers: int | None = None  # an elastic run's MIN (TrainConfig.min_workers); None: not elastic
    membership: list[MembershipChange] = field(default_factory=list)  # an elastic run's changes, in order
    relaunched_at: int = 0  # len(membership) at the last relaunch: the changes since then are this launch's

    def __post_init__(self) -> None:
        if not self.workers:
            self.workers = [WorkerProgress(rank=r) for r in range(self.world_size)]
        self._aggregator = EpochAggregator(self.world_size)

    # -- derived --------------------------------------------------------
    @property
    def epochs_done(self) -> int:
        return len(self.epoch_seconds)

    @property
    def elapsed(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.started

    @property
    def eta(self) -> float | None:
        if not self.epoch_seconds:
            return None
        per_epoch = sum(self.epoch_seconds) / len(self.epoch_seconds)
        return per_epoch * (self.epochs - self.initial_epoch - self.epochs_done)

    @property
    def throughput(self) -> float:
        """Training samples per second in the last finished epoch, all workers together."""
        if not self.epoch_seconds or self.epoch_seconds[-1] <= 0:
            return 0.0
        return self.epoch_samples[-1] / self.epoch_seconds[-1]

    # -- events ---------------------------------------------------------
    def worker_connected(self, rank: int, host: str, pid: int | None) -> None:
        w = self.workers[rank]
        w.host, w.pid = host, pid
        self.status = "running" if self.status in ("starting", "restarting") else self.status

    def worker_progress(self, rank: int, progress: Progress | State) -> None:
        """A worker's position and timing; what the message leaves out (None) stays as it was."""
        p = progress.as_progress() if isinstance(progress, State) else progress
        w = self.workers[rank]
        w.state = p.state
        for name in ("epoch", "batch", "batches", "samples_done", "compute_seconds", "sync_seconds", "device"):
            value = getattr(p, name)
            if value is not None:
                setattr(w, name, value)

    def worker_epoch(self, rank: int, epoch: Epoch) -> dict[str, float] | None:
        """Record one worker's epoch end; return the merged logs once every worker reported."""
        self.worker_progress(rank, epoch.as_progress())
        report = {"logs": epoch.all_logs, "samples": epoch.samples, "val_samples": epoch.val_samples,
                  "seconds": epoch.seconds}
        reports = self._aggregator.add(rank, epoch.epoch, report)
        if reports is None:
            return None
        return self._merged(reports)

    def _merged(self, reports: list[dict[str, Any]]) -> dict[str, Any]:
        merged = merge_epoch_logs(reports)
        if self.first_metric_at is None:
            self.first_metric_at = time.monotonic() - self.started
        # Workers time their own epochs, so start-up is not billed to epoch 1.
        self.epoch_seconds.append(max(r["seconds"] for r in reports))
        self.epoch_samples.append(sum(r["samples"] for r in reports))
        for key, value in merged.items():
            if not isinstance(value, np.ndarray):  # array results: in the fit's History only, not the dashboard's
                self.history.setdefault(key, []).append(value)
        return merged

    def worker_finished(self, rank: int, state: str, error: str = "") -> None:
        w = self.workers[rank]
        w.state = state
        w.error = error

    def restarting(self, completed: int) -> None:
        """The workers are being relaunched to continue after ``completed`` epochs (counted from 0).

        Epochs past ``completed`` were lost with the workers; the history is cut back in place
        (a notebook may hold the live dict), and every worker starts over.
        """
        self.restarts += 1
        self.status = "restarting"
        self.relaunched_at = len(self.membership)  # the relaunched workers take the launch ranks afresh
        for values in self.history.values():
            del values[completed:]
        keep = max(0, completed - self.initial_epoch)
        del self.epoch_seconds[keep:]
        del self.epoch_samples[keep:]
        self._aggregator = EpochAggregator(self.world_size)
        self.workers = [WorkerProgress(rank=w.rank, samples=w.samples, batches=w.batches) for w in self.workers]

    def workers_left(self, ranks: set[int], world_size: int) -> list[tuple[int, dict[str, Any]]]:
        """Workers ``ranks`` of an elastic run left: each epoch its ``world_size`` others have all reported is
        merged now (epoch, merged logs), oldest first; their later epochs are counted without them."""
        for r in ranks:
            self.workers[r].state = "failed"
        return [(epoch, self._merged(reports)) for epoch, reports in self._aggregator.without(ranks, world_size)]

    def regrouped(self, change: MembershipChange) -> None:
        """The survivors (and joiners) go on from their commit after ``change.committed`` epochs: later epochs
        are cut back, as for a restart, and the world is theirs. A change with nobody leaving or joining (the
        joiners waited for did not come) is no change to say."""
        if change.left or change.joined or not change.started:
            self.membership.append(change)
        self.world_size = len(change.workers)
        for values in self.history.values():
            del values[change.committed:]
        keep = max(0, change.committed - self.initial_epoch)
        del self.epoch_seconds[keep:]
        del self.epoch_samples[keep:]
        self._aggregator = EpochAggregator(self.world_size)

    def noted(self, change: MembershipChange) -> None:
        """A change that opens no generation: a joiner that did not start (``change.started`` False)."""
        self.membership.append(change)

    def joiner_added(self, rank: int) -> None:
        """An elastic run started worker ``rank`` (a replacement): a row of its own from now on."""
        self.workers.append(WorkerProgress(rank=rank))

    def finish(self, status: str, error: str = "") -> None:
        self.status = status
        self.error = error
        self.finished_at = time.monotonic()
        for w in self.workers:
            if w.state not in ("done", "failed"):
                w.state = "stopped" if status != "done" else "done"
