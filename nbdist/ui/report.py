"""An evaluation result as a table: HTML in a notebook, text in a terminal (pure formatting)."""
from __future__ import annotations

import html
import math
from typing import Any

import numpy as np

# Keys of the result dict that are not compiled metrics.
REPORT_KEYS = ("samples", "kind", "confusion_matrix", "per_class", "averages")


def _fmt(value: Any) -> str:
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):
        return "nan" if math.isnan(value) else f"{value:.4f}"
    arr = np.asarray(value)
    return np.array2string(arr, precision=4, separator=", ")


def metric_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(k, _fmt(v)) for k, v in result.items() if k not in REPORT_KEYS]
    # The report's accuracy under a compiled metric's own name is that metric again: shown once.
    rows += [(k, _fmt(v)) for k, v in (result.get("averages") or {}).items() if k not in result]
    if "samples" in result:
        rows.append(("samples", _fmt(result["samples"])))
    return rows


def class_rows(result: dict[str, Any]) -> list[list[str]]:
    per = result.get("per_class") or {}
    return [[str(c), _fmt(d["precision"]), _fmt(d["recall"]), _fmt(d["f1"]), str(d["support"])]
            for c, d in per.items()]


def _text_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).rjust(w) for c, w in zip(cells, widths))
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def to_text(result: dict[str, Any]) -> str:
    parts = [_text_table(["metric", "value"], [list(r) for r in metric_rows(result)])]
    if result.get("per_class"):
        parts.append("per class\n" + _text_table(["class", "precision", "recall", "f1", "support"],
                                                   class_rows(result)))
    cm = result.get("confusion_matrix")
    if cm is not None:
        k = len(cm)
        rows = [[f"true {i}"] + [str(int(v)) for v in cm[i]] for i in range(k)]
        parts.append("confusion matrix (rows: true class, columns: predicted)\n"
                     + _text_table([""] + [f"pred {j}" for j in range(k)], rows))
    return "\n\n".join(parts)


def _html_table(header: list[str], rows: list[list[str]], caption: str = "") -> str:
    cap = f"<caption>{html.escape(caption)}</caption>" if caption else ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="nbdist-eval">{cap}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def to_html(result: dict[str, Any]) -> str:
    parts = [_html_table(["metric", "value"], [list(r) for r in metric_rows(result)], "metrics")]
    if result.get("per_class"):
        parts.append(_html_table(["class", "precision", "recall", "f1", "support"], class_rows(result),
                                 "per class"))
    cm = result.get("confusion_matrix")
    if cm is not None:
        k = len(cm)
        peak = max(1, int(np.max(cm)))
        cells = []
        for i in range(k):
            tds = "".join(
                f'<td style="background: rgba(31,119,180,{0.08 + 0.7 * int(cm[i][j]) / peak:.2f})">{int(cm[i][j])}</td>'
                for j in range(k))
            cells.append(f"<tr><th>true {i}</th>{tds}</tr>")
        head = "".join(f"<th>pred {j}</th>" for j in range(k))
        parts.append(f'<table class="nbdist-eval"><caption>confusion matrix</caption><thead><tr><th></th>{head}'
                     f"</tr></thead><tbody>{''.join(cells)}</tbody></table>")
    return '<div style="display:flex; gap:2em; flex-wrap:wrap; align-items:flex-start">' + "".join(parts) + "</div>"


class EvaluationReport:
    """Displays as HTML in a notebook and as text in a terminal (IPython picks the richest)."""

    def __init__(self, result: dict[str, Any]) -> None:
        self.result = result

    def _repr_html_(self) -> str:
        return to_html(self.result)

    def __repr__(self) -> str:
        return to_text(self.result)
