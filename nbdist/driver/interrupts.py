"""Interrupts held while workers are being stopped (a run's stop, a search's bookkeeping): on the
notebook's main thread, a second Ctrl-C must not cut a stop in half and leave workers behind."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


HOLDS = "nbdist_holds_interrupts"  # marks the SIGINT handler of an enclosing ``interrupts_held``


@contextlib.contextmanager
def interrupts_held(defer: bool = False) -> Iterator[None]:
    """On the main thread, turn SIGINT into a log line for the duration (Python raises
    KeyboardInterrupt only there, and only its handler can be swapped).

    ``defer``: raise it once the block ends instead, so a few steps that must happen together (a
    search's trial asked for and registered) are never cut between."""
    current = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or current is None or getattr(current, HOLDS, False):
        yield  # not ours to hold, or held already by an enclosing block, which decides what a press does
        return
    pressed: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if not pressed and not defer:
            log.warning("still stopping the workers; they will be gone in a few seconds")
        pressed.append(signum)

    setattr(hold, HOLDS, True)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if defer and pressed:
        raise KeyboardInterrupt
