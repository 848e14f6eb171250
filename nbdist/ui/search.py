"""The live view of a hyperparameter search (``%%dist_tune``): a table of trials, a best-so-far chart
and each trial's curve of the objective per epoch.

``search_rows`` / ``search_sentence`` / ``search_charts`` turn the pure ``SearchState`` into what is
shown; the renderers only draw it: widgets with bqplot charts (JupyterLab, Notebook:
ui/search_widgets.py), HTML with inline SVG charts updated in place (a kernel without widgets;
appended per trial in Zeppelin, which drops display updates), or text lines in a terminal. Each is a
listener ``renderer(kind, state, payload)`` with kind "start", "trial" (a trial started or ended),
"epoch" (a trial's merged epoch) and "end".
"""
from __future__ import annotations

import html
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, TextIO

from ..driver.search_state import SearchState, TrialRow

HEADER = ["trial", "state", "params", "epochs", "objective", "best epoch"]
# Redraws of the in-place view at most this often while trials report epochs.
REDRAW_SECONDS = 0.5
# A trial's curve by its state: running trials stand out, ended ones stay for comparison.
TRIAL_COLOURS = {"running": "#1f77b4", "complete": "#2ca02c", "pruned": "#ff7f0e", "failed": "#d62728",
                 "interrupted": "#7f7f7f"}
BEST_COLOUR = "#9467bd"


@dataclass
class ChartLine:
    label: str
    x: list[float]
    y: list[float]
    colour: str
    running: bool = False


@dataclass
class SearchCharts:
    """What the two charts show: the best value after each finished trial (x: trials finished, earlier
    sessions' counted), and each trial's objective per epoch (x: epoch, from 1)."""
    best: ChartLine
    curves: list[ChartLine]


def search_charts(state: SearchState) -> SearchCharts:
    points = state.best_so_far()
    best = ChartLine("best so far", [float(state.previous + i + 1) for i in range(len(points))],
                     [v for _, v in points], BEST_COLOUR)
    curves = [ChartLine(f"trial {r.number}", [float(e + 1) for e in range(len(r.curve))], list(r.curve),
                        TRIAL_COLOURS.get(r.state, "#333"), r.state == "running")
              for r in sorted(state.trials.values(), key=lambda r: r.number) if r.curve]
    return SearchCharts(best, curves)


def svg_chart(title: str, xlabel: str, lines: list[ChartLine], width: int = 340, height: int = 220) -> str:
    """A small line chart as inline SVG (no widgets, no image files: Zeppelin and plain HTML show it)."""
    left, right, top, bottom = 50, 10, 24, 32
    xs = [x for ln in lines for x in ln.x]
    ys = [y for ln in lines for y in ln.y if not math.isnan(y)]
    parts = [f'<svg class="nbdist-search-chart" xmlns="http://www.w3.org/2000/svg" width="{width}" '
             f'height="{height}" font-family="sans-serif" font-size="11">',
             f'<text x="{width / 2:.0f}" y="15" text-anchor="middle" font-weight="bold">{html.escape(title)}</text>',
             f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" '
             'fill="none" stroke="#bbb"/>',
             f'<text x="{(left + width - right) / 2:.0f}" y="{height - 4}" text-anchor="middle">'
             f'{html.escape(xlabel)}</text>']
    if xs and ys:
        x0, x1 = min(xs), max(xs)
        y0, y1 = min(ys), max(ys)
        if x1 - x0 < 1e-12:
            x0, x1 = x0 - 1, x1 + 1
        if y1 - y0 < 1e-12:
            pad = max(0.05 * abs(y0), 0.01)
            y0, y1 = y0 - pad, y1 + pad

        def px(x: float) -> float:
            return left + (x - x0) / (x1 - x0) * (width - left - right)

        def py(y: float) -> float:
            return height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)

        for value, anchor_y in ((y1, top + 4), (y0, height - bottom)):
            parts.append(f'<text x="{left - 4}" y="{anchor_y}" text-anchor="end">{_num(value)}</text>')
        for value, anchor in ((x0, "start"), (x1, "end")):
            parts.append(f'<text x="{px(value):.1f}" y="{height - bottom + 12}" text-anchor="{anchor}">'
                         f'{_num(value)}</text>')
        for ln in lines:
            pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in zip(ln.x, ln.y) if not math.isnan(y))
            if not pts:
                continue
            width_px = 2.5 if ln.running or ln.label == "best so far" else 1.2
            parts.append(f'<polyline class="nbdist-line" data-label="{html.escape(ln.label)}" fill="none" '
                         f'stroke="{ln.colour}" stroke-width="{width_px}" points="{pts}"><title>'
                         f'{html.escape(ln.label)}</title></polyline>')
            for x, y in zip(ln.x, ln.y):
                if not math.isnan(y):
                    parts.append(f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{ln.colour}"/>')
    else:
        parts.append(f'<text x="{(left + width - right) / 2:.0f}" y="{height / 2:.0f}" text-anchor="middle" '
                     'fill="#777">no epochs yet</text>')
    parts.append("</svg>")
    return "".join(parts)


def legend_html() -> str:
    items = " ".join(f'<span style="color:{c}">&#9632;</span> {s}' for s, c in TRIAL_COLOURS.items())
    return f'<div class="nbdist-search-legend" style="font-size:12px">trials: {items}</div>'


def charts_html(state: SearchState) -> str:
    charts = search_charts(state)
    best = svg_chart(f"best {state.objective} so far", "trials finished", [charts.best])
    curves = svg_chart(f"{state.objective} per epoch", "epoch", charts.curves)
    return f'<div class="nbdist-search-charts" style="display:flex;gap:12px">{best}{curves}</div>{legend_html()}'


def _num(value: float | None) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.4g}"


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_num(v) if isinstance(v, float) else v}" for k, v in params.items())


def trial_row(state: SearchState, row: TrialRow) -> list[str]:
    best = None
    for v in row.curve:
        if state.better(v, best):
            best = v
    shown = row.value if row.state != "running" else (row.curve[-1] if row.curve else None)
    return [str(row.number), row.state, _params(row.params), f"{row.epochs_done}/{row.epochs}", _num(shown),
            _num(best)]


def search_rows(state: SearchState) -> list[list[str]]:
    return [trial_row(state, r) for r in sorted(state.trials.values(), key=lambda r: r.number)]


def search_sentence(state: SearchState) -> str:
    done = sum(state.count(s) for s in ("complete", "pruned", "failed"))
    head = {"running": "searching", "done": "search done", "interrupted": "search interrupted",
            "failed": "search failed"}[state.status]
    parts = [f"{head}: {state.previous + done}/{state.n_trials} trials finished",
             f"{len(state.running)} running (up to {state.parallel} at once)",
             f"{state.count('pruned')} pruned", f"{state.count('failed')} failed"]
    if state.best_number is not None:
        parts.append(f"best {state.objective} {_num(state.best_value)} (trial {state.best_number}, "
                     f"{'max' if state.direction == 'maximize' else 'min'})")
    parts.append(f"{state.elapsed:.0f} s")
    text = ", ".join(parts)
    return text + (f". {state.error}" if state.error else "")


def table_html(state: SearchState) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = []
    for row, cells in zip(sorted(state.trials.values(), key=lambda r: r.number), search_rows(state)):
        style = ' style="font-weight:bold"' if row.number == state.best_number else ""
        body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return f'<table class="nbdist-trials"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def search_html(state: SearchState, charts: bool = True) -> str:
    return (f'<div class="nbdist-search"><p>{html.escape(search_sentence(state))}</p>'
            f'{charts_html(state) if charts else ""}{table_html(state)}</div>')


def best_so_far_line(state: SearchState) -> str:
    """The best-so-far chart as text: the best value after each finished trial."""
    best = search_charts(state).best
    steps = ", ".join(f"{int(x)}: {_num(y)}" for x, y in zip(best.x, best.y))
    return f"best {state.objective} after each finished trial: {steps or '-'}"


def search_text(state: SearchState) -> str:
    rows = [HEADER] + search_rows(state)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([search_sentence(state), best_so_far_line(state), *lines])


class TextSearchView:
    """A line per trial that ends, and the table when the search ends."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def __call__(self, kind: str, state: SearchState, payload: Any) -> None:
        if kind == "trial" and payload is not None and state.trials[payload].state != "running":
            cells = trial_row(state, state.trials[payload])
            best = f"; best so far {_num(state.best_value)}" if state.best_value is not None else ""
            curve = ", ".join(_num(v) for v in state.trials[payload].curve)
            self.stream.write(f"trial {cells[0]} {cells[1]}: {cells[2]}; {state.objective} {cells[4]} after "
                              f"{cells[3]} epochs (per epoch: {curve or '-'}){best}\n")
        elif kind == "end":
            self.stream.write(search_text(state) + "\n")
        self.stream.flush()


class HtmlSearchView:
    """The table and the charts as HTML: updated in place ("update"), or one block per ended trial ("append")."""

    def __init__(self, mode: str = "update") -> None:
        self.mode = mode
        self._handle: Any = None
        self._drawn = 0.0

    def __call__(self, kind: str, state: SearchState, payload: Any) -> None:
        from IPython.display import HTML, display

        if self.mode == "append":
            if kind == "end" or (kind == "trial" and payload is not None and state.trials[payload].state != "running"):
                display(HTML(search_html(state)))
            return
        if kind == "start" or self._handle is None:
            self._handle = display(HTML(search_html(state)), display_id=True)
            self._drawn = time.monotonic()
            return
        if kind == "epoch" and time.monotonic() - self._drawn < REDRAW_SECONDS:
            return
        self._handle.update(HTML(search_html(state)))
        self._drawn = time.monotonic()


__all__ = ["ChartLine", "HtmlSearchView", "SearchCharts", "TextSearchView", "search_charts",
           "search_html", "search_rows", "search_sentence", "search_text", "svg_chart", "table_html"]
