"""What a hyperparameter search looks like from the notebook: pure state of its trials.

``nbdist.tune`` (search/scheduler.py) fills it as trials start, report merged epochs and end; the search
view (ui/search.py) reads it. Nothing here knows about Optuna, IPython or sockets.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

TRIAL_STATES = ("running", "complete", "pruned", "failed", "interrupted")


@dataclass
class TrialRow:
    number: int
    params: dict[str, Any]
    epochs: int  # planned
    state: str = "running"
    started: float = field(default_factory=time.monotonic)
    ready_at: float | None = None  # every worker of the trial connected
    first_epoch_at: float | None = None
    ended: float | None = None
    curve: list[float] = field(default_factory=list)  # the objective's merged value per epoch
    value: float | None = None  # what the study was told (complete) or the last reported value (pruned)
    error: str = ""
    worker_pids: list[int] = field(default_factory=list)

    @property
    def epochs_done(self) -> int:
        return len(self.curve)


@dataclass
class SearchState:
    objective: str
    direction: str  # "maximize" | "minimize"
    n_trials: int
    parallel: int
    previous: int = 0  # trials the study had finished before this session (a resumed search)
    status: str = "running"  # running | done | interrupted | failed
    error: str = ""
    started: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    trials: dict[int, TrialRow] = field(default_factory=dict)
    best_value: float | None = None  # over the whole study, resumed trials included
    best_number: int | None = None
    previous_best: float | None = None  # the best value of the trials finished before this session

    def better(self, a: float, b: float | None) -> bool:
        if b is None or math.isnan(b):
            return not math.isnan(a)
        return a > b if self.direction == "maximize" else a < b

    # -- events ---------------------------------------------------------
    def trial_started(self, number: int, params: dict[str, Any], epochs: int) -> TrialRow:
        row = TrialRow(number, dict(params), epochs)
        self.trials[number] = row
        return row

    def trial_ready(self, number: int) -> None:
        row = self.trials[number]
        if row.ready_at is None:
            row.ready_at = time.monotonic()

    def trial_epoch(self, number: int, value: float) -> None:
        row = self.trials[number]
        if row.first_epoch_at is None:
            row.first_epoch_at = time.monotonic()
        row.curve.append(float(value))

    def trial_ended(self, number: int, state: str, value: float | None = None, error: str = "") -> None:
        row = self.trials[number]
        row.state, row.ended, row.error = state, time.monotonic(), error
        row.value = value if value is not None else (row.curve[-1] if row.curve else None)
        if state == "complete" and row.value is not None and self.better(row.value, self.best_value):
            self.best_value, self.best_number = row.value, number

    def finish(self, status: str, error: str = "") -> None:
        self.status, self.error, self.finished_at = status, error, time.monotonic()
        for row in self.trials.values():
            if row.state == "running":
                row.state, row.ended = "interrupted", time.monotonic()

    # -- derived --------------------------------------------------------
    @property
    def running(self) -> list[TrialRow]:
        return [r for r in self.trials.values() if r.state == "running"]

    def count(self, state: str) -> int:
        return sum(1 for r in self.trials.values() if r.state == state)

    @property
    def elapsed(self) -> float:
        end = self.finished_at if self.finished_at is not None else time.monotonic()
        return end - self.started

    def best_so_far(self) -> list[tuple[int, float]]:
        """(trial number, best value among the complete trials up to it, earlier sessions' included), in
        the order trials ended."""
        out: list[tuple[int, float]] = []
        best: float | None = self.previous_best
        for row in sorted((r for r in self.trials.values() if r.ended is not None), key=lambda r: r.ended):
            if row.state == "complete" and row.value is not None and self.better(row.value, best):
                best = row.value
            if best is not None:
                out.append((row.number, best))
        return out


__all__ = ["SearchState", "TrialRow", "TRIAL_STATES"]
