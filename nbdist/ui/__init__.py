"""Renderers of a run's progress. Each is a listener: ``renderer(kind, state, payload)``.

kind is one of "start", "worker", "progress", "epoch" (payload: merged logs) and "end".
"""
from __future__ import annotations

import sys
from typing import Any, Callable, TextIO

from ..progress import RunState

Listener = Callable[[str, RunState, Any], None]


def make_renderer(ui: str, stream: TextIO | None = None) -> Listener | None:
    """The renderer for ``--ui``; ``auto`` means text until the widget dashboard lands."""
    if ui == "none":
        return None
    if ui in ("auto", "text"):
        from .text import TextRenderer

        return TextRenderer(stream or sys.stdout)
    from ..errors import NbdistError

    raise NbdistError(f"--ui {ui} is not available yet; use --ui text or --ui none.")
