"""Interrupts on the notebook's main thread, where Python raises KeyboardInterrupt: noted while a run is
followed and acted on between its steps (``interrupts_noted``), and held while workers are being stopped (a
run's stop, a search's bookkeeping: ``interrupts_held``), so that no interrupt is lost and a second Ctrl-C does
not cut a stop in half and leave workers behind."""
from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


HOLDS = "nbdist_holds_interrupts"  # marks the SIGINT handler of an enclosing ``interrupts_held``


def _ours_to_swap() -> bool:
    """Whether this thread may swap SIGINT's handler: the main thread, a Python handler in place, and no enclosing
    ``interrupts_held`` (which decides what a press does)."""
    current = signal.getsignal(signal.SIGINT)
    return threading.current_thread() is threading.main_thread() and current is not None and not getattr(
        current, HOLDS, False)


@contextlib.contextmanager
def interrupts_noted() -> Iterator[list[int]]:
    """On the main thread, SIGINT only noted for the duration (the list it yields fills up), for the caller to
    raise KeyboardInterrupt between its steps. Raised where the signal lands, a KeyboardInterrupt inside a
    garbage collector's callback (a weakref's, a ``__del__``) is printed as "Exception ignored" and lost, and the
    run would go on (seen in about 1 of 4 interrupted runs). A second press before the caller acted raises at
    once, as Python would (a notebook callback that hangs can still be broken out of). Elsewhere, or under
    ``interrupts_held``, nothing changes (the list stays empty)."""
    if not _ours_to_swap():
        yield []
        return
    pressed: list[int] = []

    def note(signum: int, frame: Any) -> None:
        pressed.append(signum)
        if len(pressed) > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def interrupts_held(defer: bool = False) -> Iterator[None]:
    """On the main thread, turn SIGINT into a log line for the duration (Python raises
    KeyboardInterrupt only there, and only its handler can be swapped).

    ``defer``: raise it once the block ends instead, so a few steps that must happen together (a
    search's trial asked for and registered) are never cut between."""
    if not _ours_to_swap():
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
