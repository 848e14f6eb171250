"""The live view of a hyperparameter search (``%%dist_tune``): a table of trials and the best so far.

``search_rows`` / ``search_sentence`` turn the pure ``SearchState`` into what is shown; the
renderers only draw it: HTML updated in place (JupyterLab, Notebook; appended per trial in
Zeppelin, which drops display updates), or text lines in a terminal. Each is a listener
``renderer(kind, state, payload)`` with kind "start", "trial" (a trial started or ended),
"epoch" (a trial's merged epoch) and "end".
"""
from __future__ import annotations

import html
import math
import os
import sys
import time
from typing import Any, TextIO

from ..driver.search_state import SearchState, TrialRow

HEADER = ["trial", "state", "params", "epochs", "objective", "best epoch"]
# Redraws of the in-place view at most this often while trials report epochs.
REDRAW_SECONDS = 0.5


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


def search_html(state: SearchState) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = []
    for row, cells in zip(sorted(state.trials.values(), key=lambda r: r.number), search_rows(state)):
        style = ' style="font-weight:bold"' if row.number == state.best_number else ""
        body.append(f"<tr{style}>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return (f'<div class="nbdist-search"><p>{html.escape(search_sentence(state))}</p>'
            f'<table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>')


def search_text(state: SearchState) -> str:
    rows = [HEADER] + search_rows(state)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join([search_sentence(state), *lines])


class TextSearchView:
    """A line per trial that ends, and the table when the search ends."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout

    def __call__(self, kind: str, state: SearchState, payload: Any) -> None:
        if kind == "trial" and payload is not None and state.trials[payload].state != "running":
            cells = trial_row(state, state.trials[payload])
            self.stream.write(f"trial {cells[0]} {cells[1]}: {cells[2]}; {state.objective} {cells[4]} after "
                              f"{cells[3]} epochs\n")
        elif kind == "end":
            self.stream.write(search_text(state) + "\n")
        self.stream.flush()


class HtmlSearchView:
    """The table as HTML: updated in place ("update"), or one block per ended trial ("append")."""

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


def make_search_view(ui: str, stream: TextIO | None = None) -> Any:
    """The view for ``--ui`` (auto: as the training dashboard decides; widgets draw the HTML table)."""
    if ui == "auto":
        from . import detect_frontend

        ui = os.environ.get("NBDIST_UI", "").strip().lower() or detect_frontend()
    if ui == "none":
        return None
    if ui == "text":
        return TextSearchView(stream)
    zeppelin = "ZEPPELIN_HOME" in os.environ or "ZEPPELIN_INTERPRETER" in os.environ
    return HtmlSearchView("append" if zeppelin else "update")


__all__ = ["HtmlSearchView", "TextSearchView", "make_search_view", "search_html", "search_rows", "search_sentence",
           "search_text"]
