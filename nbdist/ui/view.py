"""What the dashboard shows, computed from a ``RunState``: pure, no widgets, no IPython.

The widget, HTML and text renderers all read these values, so what a user sees is the
same in every frontend and is tested here in milliseconds.
"""
from __future__ import annotations

import html
import time
from dataclasses import dataclass, field

from ..driver.state import MembershipChange, RunState, WorkerProgress

# At most this many redraws per second (the limit is 5).
MAX_REDRAWS_PER_SECOND = 5.0

STATE_COLOURS = {
    "starting": "#888888", "training": "#1f77b4", "synchronising": "#ff7f0e",
    "done": "#2ca02c", "failed": "#d62728", "stopped": "#9467bd", "restarting": "#e377c2",
    "running": "#1f77b4", "gone": "#7f7f7f",
}


def restarts(state: RunState) -> int:
    """How often the workers were relaunched (``RunState.restarts`` exists once restarts are built)."""
    return int(getattr(state, "restarts", 0) or 0)


def gone(state: RunState) -> dict[int, MembershipChange]:
    """An elastic run's workers that left (or never started) since its last relaunch, by launch rank: the change
    that took each. One that joined later (a late starter) is not gone, nor one a relaunch started again."""
    out: dict[int, MembershipChange] = {}
    for change in state.membership[state.relaunched_at:]:
        out.update({r: change for r in change.left})
        for r in change.joined:
            out.pop(r, None)
    return out


def membership_line(change: MembershipChange) -> str:
    """One change of an elastic run's workers, for the dashboard's list: the text UI's line and who trains now."""
    who = ", ".join(str(r) for r in change.workers)
    return f"{change.line} (now worker{'' if len(change.workers) == 1 else 's'} {who})"


def format_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


@dataclass(frozen=True)
class Overview:
    epochs_done: int
    epochs_total: int
    elapsed: str
    eta: str
    throughput: float
    status: str
    restarts: int = 0
    gone: int = 0  # an elastic run's workers that left or never started

    @property
    def line(self) -> str:
        again = f" · restarted {self.restarts}×" if self.restarts else ""
        left = f" · {self.gone} worker{'' if self.gone == 1 else 's'} gone" if self.gone else ""
        return (f"Epoch {self.epochs_done}/{self.epochs_total} · elapsed {self.elapsed} · "
                f"ETA {self.eta} · {self.throughput:,.0f} samples/s{again}{left}")


def overview(state: RunState) -> Overview:
    done = state.initial_epoch + state.epochs_done
    eta = 0.0 if state.status == "done" else state.eta
    return Overview(done, state.epochs, format_seconds(state.elapsed), format_seconds(eta),
                    state.throughput, state.status, restarts(state), len(gone(state)))


@dataclass(frozen=True)
class WorkerRow:
    rank: int
    state: str
    fraction: float  # of this worker's whole run, 0..1
    compute_seconds: float
    sync_seconds: float
    detail: str  # e.g. "epoch 3/20 · batch 12/29"

    @property
    def sync_fraction(self) -> float:
        total = self.compute_seconds + self.sync_seconds
        return self.sync_seconds / total if total > 0 else 0.0


def worker_fraction(w: WorkerProgress, state: RunState) -> float:
    if w.state == "done":
        return 1.0
    epochs = max(1, state.epochs - state.initial_epoch)
    within = w.batch / w.batches if w.batches else 0.0
    return min(1.0, max(0.0, (w.epoch - state.initial_epoch + within) / epochs))


def worker_rows(state: RunState) -> list[WorkerRow]:
    """One row per launched worker; one an elastic run went on without is "gone", with when and why."""
    rows, left = [], gone(state)
    for w in state.workers:
        where = f"{w.host} pid {w.pid}" if w.pid else "not connected yet"
        where += f" · {w.device}" if w.device else ""
        detail = f"epoch {min(w.epoch + 1, state.epochs)}/{state.epochs} · batch {w.batch}/{w.batches} · {where}"
        change = left.get(w.rank)
        if change is not None and not change.started:
            detail = f"did not start ({change.why})"
        elif change is not None:
            detail = f"left in epoch {change.committed + 1} ({change.why}) · {where}"
        rows.append(WorkerRow(w.rank, "gone" if change is not None else w.state, worker_fraction(w, state),
                              w.compute_seconds, w.sync_seconds, detail))
    return rows


def epoch_ticks(epochs: list[int], most: int = 10) -> list[int]:
    """Whole epochs to label on an x axis, at most ``most`` of them (the last one always)."""
    if not epochs:
        return []
    step = -(-len(epochs) // most)
    ticks = epochs[::-1][::step][::-1]  # counted back from the last epoch, so it is labelled
    return ticks


@dataclass
class EpochPhases:
    """Seconds per epoch in compute and in synchronisation (mean over workers): the phase timeline.

    Workers report cumulative seconds; ``mark`` takes them at each epoch end and keeps the
    differences. After a restart the workers count from zero again: ``restart`` rewinds.
    So do an elastic run's survivors in their next generation (a new job).
    """

    compute: list[float] = field(default_factory=list)
    sync: list[float] = field(default_factory=list)
    _last: tuple[float, float] = (0.0, 0.0)

    def mark(self, state: RunState) -> None:
        n = max(1, len(state.workers))
        c = sum(w.compute_seconds for w in state.workers) / n
        s = sum(w.sync_seconds for w in state.workers) / n
        self.compute.append(max(0.0, c - self._last[0]))
        self.sync.append(max(0.0, s - self._last[1]))
        self._last = (c, s)

    def restart(self, epochs_kept: int) -> None:
        del self.compute[epochs_kept:]
        del self.sync[epochs_kept:]
        self._last = (0.0, 0.0)


def metric_groups(history: dict[str, list[float]]) -> dict[str, dict[str, list[float]]]:
    """``{"loss": {"train": [...], "validation": [...]}, "accuracy": {...}}`` for the charts."""
    groups: dict[str, dict[str, list[float]]] = {}
    for key, values in history.items():
        base, split = (key[4:], "validation") if key.startswith("val_") else (key, "train")
        groups.setdefault(base, {})[split] = list(values)
    return groups


def epoch_axis(state: RunState) -> list[int]:
    """1-based epoch numbers for the chart's x axis."""
    return list(range(state.initial_epoch + 1, state.initial_epoch + state.epochs_done + 1))


@dataclass
class Throttle:
    """Lets a redraw through at most ``rate`` times per second; forced redraws always pass."""

    rate: float = MAX_REDRAWS_PER_SECOND
    clock: object = time.monotonic
    _last: float = field(default=float("-inf"))

    @property
    def interval(self) -> float:
        return 1.0 / self.rate

    def wait_time(self) -> float:
        """Seconds until the next redraw may happen (0: now)."""
        return max(0.0, self._last + self.interval - self.clock())

    def ready(self, force: bool = False) -> bool:
        now = self.clock()
        if force or now - self._last >= self.interval:
            self._last = now
            return True
        return False


def status_sentence(state: RunState) -> str:
    if state.status == "done":
        return (f"Trained {state.epochs_done} epochs on {state.world_size} {state.backend} workers in "
                f"{format_seconds(state.elapsed)}; the model holds the trained weights.")
    if state.status == "stopped":
        return (f"Stopped ({state.error}) after {state.epochs_done} epochs; all workers ended and the model "
                "holds the last averaged weights.")
    if state.status == "failed":
        return f"Training failed: {state.error}"
    if state.status == "restarting":
        return (f"Restarting the workers (restart {restarts(state)}), continuing from epoch "
                f"{state.initial_epoch + state.epochs_done}")
    note = f" ({state.data_note})" if state.data_note else ""
    return f"{state.strategy} on {state.world_size} {state.backend} workers{note}: {state.status}"


def metrics_table_html(state: RunState) -> str:
    """Per-epoch metrics as an HTML table (the static summary and the HTML renderer use it)."""
    keys = list(state.history)
    head = "".join(f"<th>{html.escape(k)}</th>" for k in keys)
    rows = []
    for i, epoch in enumerate(epoch_axis(state)):
        cells = "".join(f"<td>{state.history[k][i]:.4f}</td>" if i < len(state.history[k]) else "<td></td>"
                        for k in keys)
        secs = state.epoch_seconds[i] if i < len(state.epoch_seconds) else 0.0
        rows.append(f"<tr><td>{epoch}</td>{cells}<td>{format_seconds(secs)}</td></tr>")
    return (f'<table class="nbdist-metrics"><thead><tr><th>epoch</th>{head}<th>time</th></tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table>")


def membership_html(state: RunState) -> str:
    """An elastic run's changes of workers as a list ("" when there were none)."""
    if not state.membership:
        return ""
    items = "".join(f"<li>{html.escape(membership_line(c))}</li>" for c in state.membership)
    return ("<div class='nbdist-membership' style='border-left:4px solid #7f7f7f;padding:2px 8px;"
            f"background:#f5f5f5'><b>workers changed {len(state.membership)}×</b>"
            f"<ul style='margin:2px 0'>{items}</ul></div>")


def workers_table_html(state: RunState) -> str:
    rows = []
    for r in worker_rows(state):
        colour = STATE_COLOURS.get(r.state, "#000")
        rows.append(f"<tr><td>worker {r.rank}</td><td style='color:{colour}'><b>{html.escape(r.state)}</b></td>"
                    f"<td>{r.fraction:.0%}</td><td>{format_seconds(r.compute_seconds)}</td>"
                    f"<td>{format_seconds(r.sync_seconds)} ({r.sync_fraction:.0%})</td></tr>")
    return ("<table class='nbdist-workers'><thead><tr><th>worker</th><th>state</th><th>progress</th>"
            f"<th>compute</th><th>synchronisation</th></tr></thead><tbody>{''.join(rows)}</tbody></table>")
