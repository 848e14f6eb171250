"""Progress as HTML for frontends that render HTML but not widgets (Zeppelin's IPython interpreter).

Two modes: ``update`` redraws one display in place (throttled); ``append`` adds one small
HTML block per epoch, for frontends that drop display updates (Zeppelin). Both end with the
static summary.
"""
from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from IPython.display import HTML, display

from ..driver.state import RunState
from .summary import summary_html
from .text import epoch_line
from .view import (
    Throttle,
    membership_html,
    membership_line,
    metrics_table_html,
    overview,
    status_sentence,
    workers_table_html,
)


def progress_html(state: RunState) -> str:
    ov = overview(state)
    pct = 100.0 * ov.epochs_done / max(1, ov.epochs_total)
    bar = (f"<div style='width:360px;border:1px solid #999;height:12px'>"
           f"<div style='width:{pct:.1f}%;background:#1f77b4;height:12px'></div></div>")
    return (f"<div class='nbdist-progress'><b>nbdist</b> · {html.escape(status_sentence(state))}"
            f"{bar}<div>{html.escape(ov.line)}</div>{membership_html(state)}{workers_table_html(state)}"
            f"{metrics_table_html(state)}</div>")


class HtmlRenderer:
    def __init__(self, mode: str = "update", show: Callable[..., Any] = display) -> None:
        if mode not in ("update", "append"):
            raise ValueError(f"mode must be 'update' or 'append', not {mode!r}")
        self.mode = mode
        self._show = show
        self._handle: Any = None
        self._throttle = Throttle()

    def __call__(self, kind: str, state: RunState, payload: Any) -> None:
        if kind == "start":
            if self.mode == "update":
                self._handle = self._show(HTML(progress_html(state)), display_id=True)
            else:
                self._show(HTML(f"<div class='nbdist-start'><b>nbdist</b> · {html.escape(status_sentence(state))}"
                                f", {state.epochs} epochs</div>"))
        elif kind == "end":
            if self._handle is not None:
                self._handle.update(HTML(progress_html(state)))
            self._show(HTML(summary_html(state)))
        elif kind == "restart" and self.mode == "append":
            self._show(HTML(f"<div class='nbdist-restart'><b>nbdist</b> · {html.escape(str(payload))}</div>"))
        elif kind == "membership" and self.mode == "append":  # an elastic run's change (MembershipChange)
            self._show(HTML(f"<div class='nbdist-membership'><b>nbdist</b> · "
                            f"{html.escape(membership_line(payload))}</div>"))
        elif kind in ("restart", "membership") and self._handle is not None:  # not throttled: rare, it matters
            self._handle.update(HTML(progress_html(state)))
        elif self.mode == "append":
            if kind == "epoch":
                self._show(HTML(f"<div class='nbdist-epoch'><code>{html.escape(epoch_line(state, payload))}"
                                "</code></div>"))
        elif self._handle is not None and self._throttle.ready():
            # Throttled; the "end" redraw above always shows the final numbers.
            self._handle.update(HTML(progress_html(state)))
