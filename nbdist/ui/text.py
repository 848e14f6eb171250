"""Plain-text progress: one line per epoch, Keras style, plus a start and an end line."""
from __future__ import annotations

from typing import Any, TextIO

from ..driver.state import RunState


def format_metrics(logs: dict[str, float]) -> str:
    return " - ".join(f"{k}: {v:.4f}" for k, v in logs.items())


def format_seconds(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    return f"{minutes}m{sec:02d}s"


def epoch_line(state: RunState, logs: dict[str, float]) -> str:
    epoch = state.initial_epoch + state.epochs_done
    width = len(str(state.epochs))
    took = state.epoch_seconds[-1] if state.epoch_seconds else 0.0
    return (f"Epoch {epoch:>{width}}/{state.epochs} - {format_metrics(logs)} - {format_seconds(took)}"
            f" - {state.throughput:,.0f} samples/s")


def end_line(state: RunState) -> str:
    if state.status == "done":
        return (f"nbdist: trained {state.epochs_done} epochs on {state.world_size} workers in "
                f"{format_seconds(state.elapsed)}; the model holds the trained weights.")
    if state.status == "stopped":
        return (f"nbdist: stopped ({state.error}) after {state.epochs_done} epochs; all workers ended.")
    return f"nbdist: training failed: {state.error}"


class TextRenderer:
    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def __call__(self, kind: str, state: RunState, payload: Any) -> None:
        if kind == "start":
            note = f"; {state.data_note}" if state.data_note else ""
            left = state.min_workers
            verb = "is" if left == 1 else "are"
            elastic = f" (elastic: goes on while {left} {verb} left)" if left is not None else ""
            self._write(f"nbdist: {state.strategy} on {state.world_size} {state.backend} workers{elastic}, "
                        f"{state.epochs} epochs{note}")
        elif kind == "epoch":
            self._write(epoch_line(state, payload))
        elif kind == "restart":
            self._write(f"nbdist: {payload}")
        elif kind == "membership":  # an elastic run's change of workers (driver/state.py MembershipChange)
            self._write(f"nbdist: {payload.line}")
        elif kind == "end" and state.status != "failed":
            self._write(end_line(state))

    def _write(self, line: str) -> None:
        self.stream.write(line + "\n")
        self.stream.flush()
