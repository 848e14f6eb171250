"""The live view of a search as widgets: the sentence and table of trials (HTML widgets) and two bqplot
charts, the best value so far and each trial's objective per epoch (running trials drawn thick).

What is drawn comes from ``search_charts`` / ``table_html`` (ui/search.py); this module only puts it
on widgets, from the thread that runs the search (the notebook's main thread), at most every
``REDRAW_SECONDS`` while trials report epochs and always when a trial starts or ends.
"""
from __future__ import annotations

import html
import time
from collections.abc import Callable
from typing import Any

import bqplot
import ipywidgets as W
from IPython.display import display

from ..driver.search_state import SearchState
from .search import REDRAW_SECONDS, ChartLine, legend_html, search_charts, search_sentence, table_html
from .view import epoch_ticks

STATUS_COLOURS = {"running": "#1f77b4", "done": "#2ca02c", "interrupted": "#7f7f7f", "failed": "#d62728"}


class LineChart:
    """One bqplot figure whose lines are replaced by the given ``ChartLine``s on each update."""

    def __init__(self, title: str, xlabel: str) -> None:
        self.x_scale = bqplot.LinearScale()
        self.y_scale = bqplot.LinearScale()
        self.x_axis = bqplot.Axis(scale=self.x_scale, label=xlabel, tick_format="d")
        axes = [self.x_axis, bqplot.Axis(scale=self.y_scale, orientation="vertical")]  # the title names it
        self.lines: dict[str, bqplot.Lines] = {}
        self.figure = bqplot.Figure(marks=[], axes=axes, title=title,
                                    fig_margin={"top": 40, "bottom": 40, "left": 55, "right": 15},
                                    layout=W.Layout(width="380px", height="260px"))

    def update(self, lines: list[ChartLine]) -> None:
        xs = sorted({int(x) for ln in lines for x in ln.x})
        self.x_axis.tick_values = epoch_ticks(xs) if xs else []
        values = [v for ln in lines for v in ln.y]
        flat = bool(values) and max(values) - min(values) < 1e-9
        pad = max(0.05 * abs(values[0]), 0.01) if flat else 0.0
        self.y_scale.min = values[0] - pad if flat else None
        self.y_scale.max = values[0] + pad if flat else None
        for ln in lines:
            mark = self.lines.get(ln.label)
            if mark is None:
                mark = bqplot.Lines(x=[], y=[], scales={"x": self.x_scale, "y": self.y_scale}, labels=[ln.label],
                                    marker="circle", marker_size=12)
                self.lines[ln.label] = mark
                self.figure.marks = list(self.figure.marks) + [mark]
            with mark.hold_sync():
                mark.x, mark.y = ln.x, ln.y
                mark.colors = [ln.colour]
                mark.stroke_width = 3.0 if ln.running or ln.label == "best so far" else 1.5


class WidgetSearchView:
    """A search listener drawing the table and the charts in the cell that runs the search."""

    def __init__(self, show: Callable[..., Any] = display) -> None:
        self._show = show
        self._drawn = float("-inf")
        self.draws = 0
        self.header = W.HTML()
        self.table = W.HTML()
        self.best = LineChart("best so far", "trials finished")
        self.curves = LineChart("per epoch", "epoch")
        self.root = W.VBox([self.header, W.HBox([self.best.figure, self.curves.figure],
                                                layout=W.Layout(flex_flow="row wrap")),
                            W.HTML(legend_html()), self.table])
        self.root.add_class("nbdist-search-dashboard")

    def __call__(self, kind: str, state: SearchState, payload: Any) -> None:
        if kind == "start":
            self.best.figure.title = f"best {state.objective} so far"
            self.curves.figure.title = f"{state.objective} per epoch"
            self._draw(state)
            self._show(self.root)
            return
        if kind == "epoch" and time.monotonic() - self._drawn < REDRAW_SECONDS:
            return
        self._draw(state)

    def _draw(self, state: SearchState) -> None:
        self.draws += 1
        self._drawn = time.monotonic()
        colour = STATUS_COLOURS.get(state.status, "#1f77b4")
        self.header.value = (f"<span style='font-size:14px'><b>nbdist search</b> · "
                             f"{html.escape(search_sentence(state))}</span> <span class='nbdist-status' "
                             f"style='background:{colour};color:white;padding:1px 9px;border-radius:9px'>"
                             f"<b>{html.escape(state.status)}</b></span>")
        charts = search_charts(state)
        self.best.update([charts.best])
        self.curves.update(charts.curves)
        self.table.value = table_html(state)


__all__ = ["LineChart", "WidgetSearchView"]
