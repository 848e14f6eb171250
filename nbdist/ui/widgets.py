"""The live dashboard: ipywidgets for progress and state, bqplot for the charts.

Widget values are set from whichever thread pumps the job's events (the main thread in
blocking mode, a daemon thread with ``--background``): kernel-to-browser updates are safe
from any thread. Nothing here uses ``with output:`` or ``clear_output``; everything is
updated in place, at most ``MAX_REDRAWS_PER_SECOND`` times per second.
"""
from __future__ import annotations

import html
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import bqplot
import ipywidgets as W
from IPython.display import HTML, display

from ..driver.state import RunState
from .summary import summary_html
from .view import (
    STATE_COLOURS,
    EpochPhases,
    Throttle,
    epoch_axis,
    epoch_ticks,
    membership_html,
    metric_groups,
    overview,
    status_sentence,
    worker_rows,
)

log = logging.getLogger(__name__)

SPLIT_COLOURS = {"train": "#1f77b4", "validation": "#ff7f0e"}
LOG_LINES = 12
LOG_INTERVAL = 1.0  # seconds between reads of the workers' log files


def phase_note(row: Any) -> str:
    """The share of this worker's time spent synchronising so far, e.g. " · sync 12%"."""
    if row.compute_seconds + row.sync_seconds <= 0:
        return ""
    return f" · sync {row.sync_fraction:.0%}"


class MetricChart:
    """One bqplot figure per metric: a training and a validation line, one point per epoch."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.x_scale = bqplot.LinearScale()
        self.y_scale = bqplot.LinearScale()
        self.lines: dict[str, bqplot.Lines] = {}
        # Whole epochs only: a linear axis would otherwise label 1, 1.5, 2 (shown as "1 1 2" with "d").
        self.x_axis = bqplot.Axis(scale=self.x_scale, label="epoch", tick_format="d")
        axes = [self.x_axis, bqplot.Axis(scale=self.y_scale, orientation="vertical", label=name)]
        # Losses fall and scores rise: keep the legend where the lines are not.
        corner = "top-right" if "loss" in name or "error" in name else "bottom-right"
        self.figure = bqplot.Figure(marks=[], axes=axes, title=name, legend_location=corner,
                                    fig_margin={"top": 40, "bottom": 40, "left": 55, "right": 15},
                                    layout=W.Layout(width="340px", height="250px"))

    def update(self, x: list[int], series: dict[str, list[float]]) -> None:
        self.x_axis.tick_values = epoch_ticks(x)
        # One epoch (or a flat line) gives the y axis an empty range and meaningless ticks: widen it.
        values = [v for vs in series.values() for v in vs]
        flat = bool(values) and max(values) - min(values) < 1e-9
        pad = max(0.05 * abs(values[0]), 0.01) if flat else 0.0
        self.y_scale.min = values[0] - pad if flat else None
        self.y_scale.max = values[0] + pad if flat else None
        for split, values in series.items():
            line = self.lines.get(split)
            if line is None:
                line = bqplot.Lines(x=[], y=[], scales={"x": self.x_scale, "y": self.y_scale},
                                    colors=[SPLIT_COLOURS.get(split, "#333")], labels=[split],
                                    display_legend=True, marker="circle", marker_size=16)
                self.lines[split] = line
                self.figure.marks = list(self.figure.marks) + [line]
            with line.hold_sync():
                line.x = x[:len(values)]
                line.y = values


class PhaseChart:
    """Per worker, seconds in compute vs synchronisation as stacked horizontal bars."""

    def __init__(self, world_size: int) -> None:
        self.x_scale = bqplot.OrdinalScale()
        self.y_scale = bqplot.LinearScale(min=0.0)
        labels = [f"worker {r}" for r in range(world_size)]
        self.bars = bqplot.Bars(x=labels, y=[[0.0] * world_size, [0.0] * world_size],
                                scales={"x": self.x_scale, "y": self.y_scale}, type="stacked",
                                orientation="horizontal", colors=["#1f77b4", "#ff7f0e"],
                                labels=["compute", "synchronisation"])
        axes = [bqplot.Axis(scale=self.x_scale, orientation="vertical"),
                bqplot.Axis(scale=self.y_scale, label="seconds")]
        self.figure = bqplot.Figure(marks=[self.bars], axes=axes, title="time per phase",
                                    fig_margin={"top": 40, "bottom": 40, "left": 70, "right": 15},
                                    layout=W.Layout(width="420px", height=f"{140 + 30 * world_size}px"))

    def update(self, compute: list[float], sync: list[float]) -> None:
        self.bars.y = [compute, sync]


class EpochPhaseChart:
    """The phase timeline: per epoch, seconds in compute and in synchronisation (mean over workers)."""

    def __init__(self) -> None:
        # A linear epoch axis (not ordinal): labels can be thinned, so 200 epochs stay readable.
        self.x_scale = bqplot.LinearScale()
        self.y_scale = bqplot.LinearScale(min=0.0)
        self.bars = bqplot.Bars(x=[], y=[[], []], scales={"x": self.x_scale, "y": self.y_scale}, type="stacked",
                                colors=["#1f77b4", "#ff7f0e"], labels=["compute", "synchronisation"],
                                padding=0.15)
        self.x_axis = bqplot.Axis(scale=self.x_scale, label="epoch", tick_format="d")
        axes = [self.x_axis, bqplot.Axis(scale=self.y_scale, orientation="vertical", label="seconds")]
        self.figure = bqplot.Figure(marks=[self.bars], axes=axes, title="seconds per epoch",
                                    fig_margin={"top": 40, "bottom": 40, "left": 55, "right": 15},
                                    layout=W.Layout(width="340px", height="250px"))

    def update(self, epochs: list[int], phases: EpochPhases) -> None:
        n = min(len(epochs), len(phases.compute))
        if n:  # half an epoch of margin, so the first and last bars are whole
            self.x_scale.min, self.x_scale.max = epochs[0] - 0.5, epochs[n - 1] + 0.5
        self.x_axis.tick_values = epoch_ticks(epochs[:n])
        x, compute, sync = epochs[:n], phases.compute[:n], phases.sync[:n]
        if n == 1:  # bar width comes from the spacing of x: add an empty bar just outside the axis
            x, compute, sync = [x[0] - 1] + x, [0.0] + compute, [0.0] + sync
        with self.bars.hold_sync():
            self.bars.x = x
            self.bars.y = [compute, sync]


class WidgetDashboard:
    """A ``TrainingJob`` listener that draws the dashboard in the cell that started the run."""

    def __init__(self, show: Callable[..., Any] = display) -> None:
        self._show = show
        self._job: Any = None
        self._state: RunState | None = None
        self._lock = threading.RLock()
        self._throttle = Throttle()
        self._timer: threading.Timer | None = None
        self._last_log_read = float("-inf")
        self._summary_handle: Any = None
        self.draws = 0
        self._dirty = False
        self.charts: dict[str, MetricChart] = {}

        self.header = W.HTML()
        self.epochs_bar = W.IntProgress(value=0, min=0, max=1, description="epochs",
                                        layout=W.Layout(width="420px"))
        self.overview = W.HTML()
        self.stop_button = W.Button(description="Stop", button_style="danger", icon="stop", disabled=True,
                                    tooltip="Stop the run (with --background; otherwise interrupt the kernel)")
        self.stop_button.on_click(self._on_stop)
        # Blocking mode: a click cannot reach a busy kernel, so say what works instead.
        self.stop_hint = W.HTML("<span style='color:#777;font-size:12px'>to stop: interrupt the kernel (■); "
                                "the model keeps the last averaged weights</span>")
        self.chart_box = W.HBox(layout=W.Layout(flex_flow="row wrap"))
        self.worker_bars: list[W.FloatProgress] = []
        self.worker_states: list[W.HTML] = []
        self.worker_box = W.VBox()
        self.phase: PhaseChart | None = None
        self.timeline = EpochPhaseChart()
        self.epoch_phases = EpochPhases()
        self.phase_box = W.Box()
        # One legend for both phase charts (bqplot's legend for stacked bars covers the bars).
        self.phase_legend = W.HTML(
            "<span style='font-size:12px'>phases: <span style='color:#1f77b4'>■</span> compute "
            "<span style='color:#ff7f0e'>■</span> synchronisation (averaging / allreduce)</span>")
        self.error_panel = W.HTML(layout=W.Layout(display="none"))
        self.notice = W.HTML(layout=W.Layout(display="none"))  # restarts, with their reasons
        self._restart_reasons: list[str] = []
        self.changes = W.HTML(layout=W.Layout(display="none"))  # an elastic run's changes of workers
        self.logs: list[W.HTML] = []
        self.log_panel = W.Accordion()
        self.root = W.VBox([
            self.header,
            W.HBox([self.epochs_bar, self.stop_button, self.stop_hint], layout=W.Layout(align_items="center")),
            self.overview,
            self.chart_box,
            W.HBox([self.worker_box, W.VBox([self.phase_legend, self.phase_box])],
                   layout=W.Layout(flex_flow="row wrap")),
            self.notice,
            self.changes,
            self.error_panel,
            self.log_panel,
        ])
        self.root.add_class("nbdist-dashboard")

    # -- wiring -----------------------------------------------------------
    def attach(self, job: Any) -> None:
        """Give the dashboard its job: the Stop button and the workers' logs come from it."""
        self._job = job
        background = bool(getattr(job.config, "background", False))
        self.stop_button.disabled = not background
        self.stop_button.layout.display = None if background else "none"
        self.stop_hint.layout.display = "none" if background else None

    def _on_stop(self, _button: Any = None) -> None:
        if self._job is not None:
            self.stop_button.disabled = True
            self.stop_button.description = "Stopping…"
            self._job.stop("stopped from the dashboard")

    def __call__(self, kind: str, state: RunState, payload: Any) -> None:
        with self._lock:
            self._state = state
            if kind == "start":
                self._build(state)
                self._show(self.root)
                # Created on the calling (main) thread, so the end-of-run summary lands in this cell
                # even when the run ends on the background thread.
                self._summary_handle = self._show(HTML(""), display_id=True)
                self._draw()
            elif kind == "restart":  # always shown at once: a restart is rare and matters
                self.epoch_phases.restart(state.epochs_done)
                self._restart_reasons.append(str(payload or "restarting the workers"))
                self._show_restarts()
                self._throttle.ready(force=True)
                self._draw()
            elif kind == "membership":  # an elastic run's change of workers: shown at once, as a restart
                self.epoch_phases.restart(state.epochs_done)
                self.changes.value = membership_html(state)
                self.changes.layout.display = None
                self._throttle.ready(force=True)
                self._draw()
            elif kind == "end":
                self._cancel_timer()
                self._draw(final=True)
                self._finish(state)
            else:
                if kind == "epoch":
                    self.epoch_phases.mark(state)
                if kind == "worker":  # connected or finished (rare): read the logs now, while they exist
                    self._last_log_read = time.monotonic()
                    self._draw_logs()
                self._request_draw()

    # -- drawing ----------------------------------------------------------
    def _build(self, state: RunState) -> None:
        self.epochs_bar.max = max(1, state.epochs)
        self.epochs_bar.value = state.initial_epoch
        self._worker_rows(len(state.workers))
        self.log_panel.selected_index = None

    def _worker_rows(self, n: int) -> None:
        """A bar, a state and a log per worker; an elastic run's replacement adds one (``RunState.joiner_added``)."""
        self.worker_bars = [W.FloatProgress(value=0.0, min=0.0, max=1.0, description=f"worker {r}",
                                            layout=W.Layout(width="360px")) for r in range(n)]
        self.worker_states = [W.HTML() for _ in range(n)]
        self.worker_box.children = [W.HBox([b, s]) for b, s in zip(self.worker_bars, self.worker_states)]
        self.phase = PhaseChart(n)
        self.phase_box.children = [self.phase.figure, self.timeline.figure]
        self.logs = [*self.logs, *(W.HTML("<pre>(no output yet)</pre>") for _ in range(n - len(self.logs)))]
        self.log_panel.children = self.logs
        for r in range(n):
            self.log_panel.set_title(r, f"worker {r} log")

    def _request_draw(self) -> None:
        self._dirty = True
        if self._throttle.ready():
            self._draw()
        elif self._timer is None:
            # Draw the latest state once the throttle allows, so the last event is never lost.
            self._timer = threading.Timer(self._throttle.wait_time(), self._timer_draw)
            self._timer.daemon = True
            self._timer.start()

    def _timer_draw(self) -> None:
        with self._lock:
            self._timer = None
            if not self._dirty or self._state is None or self._state.finished_at is not None:
                return  # an event drew the latest state meanwhile, or the run is over
            if self._throttle.ready():
                self._draw()
            else:  # an event took this slot without drawing everything: try again when allowed
                self._timer = threading.Timer(self._throttle.wait_time(), self._timer_draw)
                self._timer.daemon = True
                self._timer.start()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _draw(self, final: bool = False) -> None:
        state = self._state
        if state is None:
            return
        self.draws += 1
        self._dirty = False
        ov = overview(state)
        colour = STATE_COLOURS.get(state.status, "#1f77b4")
        self.header.value = (f"<span style='font-size:14px'><b>nbdist</b> · {html.escape(state.strategy)} on "
                             f"{state.world_size} {html.escape(state.backend)} workers</span> "
                             + (f"<span class='nbdist-data-note'>({html.escape(state.data_note)})</span> "
                                if state.data_note else "")
                             + f"<span class='nbdist-status' style='background:{colour};color:white;padding:1px 9px;"
                             f"border-radius:9px;margin-left:6px'><b>{html.escape(state.status)}</b></span>")
        self.epochs_bar.value = ov.epochs_done
        self.epochs_bar.bar_style = {"done": "success", "failed": "danger", "stopped": "warning"}.get(
            state.status, "info")
        self.overview.value = f"<span style='font-size:13px'>{html.escape(ov.line)}</span>"
        rows = worker_rows(state)
        if len(rows) > len(self.worker_bars):  # an elastic run started a worker after launch
            self._worker_rows(len(rows))
        for row, bar, label in zip(rows, self.worker_bars, self.worker_states):
            bar.value = row.fraction
            bar.bar_style = {"done": "success", "failed": "danger", "stopped": "warning", "gone": ""}.get(
                row.state, "info")
            label.value = (f"<span class='nbdist-worker-state' style='color:{STATE_COLOURS.get(row.state)}'>"
                           f"<b>{html.escape(row.state)}</b></span> · {html.escape(row.detail)}{phase_note(row)}")
        if self.phase is not None:
            self.phase.update([r.compute_seconds for r in rows], [r.sync_seconds for r in rows])
        x = epoch_axis(state)
        self.timeline.update(x, self.epoch_phases)
        for name, series in metric_groups(state.history).items():
            chart = self.charts.get(name)
            if chart is None:
                chart = self.charts[name] = MetricChart(name)
                self.chart_box.children = [c.figure for c in self.charts.values()]
            chart.update(x, series)
        now = time.monotonic()
        if final or now - self._last_log_read >= LOG_INTERVAL:
            self._last_log_read = now
            self._draw_logs()

    def _show_restarts(self) -> None:
        items = "".join(f"<li>{html.escape(r)}</li>" for r in self._restart_reasons[-5:])
        n = len(self._restart_reasons)
        self.notice.value = ("<div class='nbdist-restarts' style='border-left:4px solid #e377c2;padding:2px 8px;"
                             f"background:#fdf2f9'><b>restarted {n}×</b><ul style='margin:2px 0'>{items}</ul></div>")
        self.notice.layout.display = None

    def _draw_logs(self) -> None:
        tail = getattr(self._job, "worker_log", None)
        if tail is None:
            return
        for rank, widget in enumerate(self.logs):
            try:
                text = tail(rank, LOG_LINES)
            except Exception:  # a log file that vanished must not break the dashboard
                log.debug("could not read worker %d's log", rank, exc_info=True)
                continue
            if not text:  # not written yet, or the run's log files are already cleaned up: keep the last
                continue
            widget.value = f"<pre class='nbdist-log' style='font-size:11px'>{html.escape(text)}</pre>"

    def _finish(self, state: RunState) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stop"
        self.stop_button.layout.display = "none"  # nothing left to stop
        self.stop_hint.layout.display = "none"
        if state.status == "failed":
            failed = [w for w in state.workers if w.error]
            trace = failed[0].error if failed else ""
            who = f"traceback from worker {failed[0].rank}" if failed else "no worker traceback"
            self.error_panel.value = (
                "<div style='border:2px solid #d62728;padding:6px;background:#fff5f5'>"
                f"<b style='color:#d62728'>{html.escape(status_sentence(state))}</b>"
                f"<details open><summary>{who}</summary><pre style='font-size:11px'>"
                f"{html.escape(trace)}</pre></details></div>")
            self.error_panel.layout.display = None
        if self._summary_handle is not None:
            self._summary_handle.update(HTML(summary_html(state)))
