"""The static end-of-run summary: an HTML table and a PNG chart that a saved notebook keeps."""
from __future__ import annotations

import base64
import html
import io
import logging

from ..driver.state import RunState
from .view import (
    epoch_axis,
    membership_html,
    metric_groups,
    metrics_table_html,
    status_sentence,
    workers_table_html,
)

log = logging.getLogger(__name__)


def chart_png(state: RunState) -> bytes | None:
    """One matplotlib panel per metric (train and validation); None when there is nothing to draw."""
    groups = metric_groups(state.history)
    if not groups:
        return None
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    except ImportError:
        log.info("matplotlib is not installed; the summary has no chart image")
        return None
    x = epoch_axis(state)
    fig = Figure(figsize=(4.2 * len(groups), 3.0), dpi=96)
    for i, (name, series) in enumerate(groups.items()):
        ax = fig.add_subplot(1, len(groups), i + 1)
        for split, values in series.items():
            ax.plot(x[:len(values)], values, marker="o", markersize=3, label=split)
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def summary_html(state: RunState, title: str = "nbdist run summary") -> str:
    png = chart_png(state)
    image = ""
    if png is not None:
        image = (f'<img class="nbdist-chart" alt="per-epoch metrics" '
                 f'src="data:image/png;base64,{base64.b64encode(png).decode()}"/>')
    error = ""
    if state.status == "failed":
        failed = [w for w in state.workers if w.error]
        if failed:
            error = (f"<details open><summary>traceback from worker {failed[0].rank}</summary>"
                     f"<pre>{html.escape(failed[0].error)}</pre></details>")
    return (f'<div class="nbdist-summary"><h4>{html.escape(title)}</h4>'
            f"<p>{html.escape(status_sentence(state))}</p>{error}{image}"
            f"{metrics_table_html(state)}{membership_html(state)}{workers_table_html(state)}</div>")
