"""Exceptions a user sees.

nbdist's own failures (bad input, an unusable environment, a worker that died or timed out) are
``NbdistError`` / ``TrainingFailed``: one sentence naming the problem and the fix. What Keras, TensorFlow
or the cell's own code raises is raised again as itself: an exception of a notebook callback propagates
unchanged, and one raised on a worker comes back as its own type with its own message, mixed with
``WorkerRaised`` (``worker_traceback``, ``rank``), shown as IPython shows a remote error.
"""
from __future__ import annotations

from typing import Any


class NbdistError(Exception):
    """Bad input or an unusable environment: shown as one sentence, never a traceback."""


class TrainingFailed(NbdistError):
    """A worker failed; ``worker_traceback`` holds the traceback from the worker itself."""

    def __init__(self, message: str, worker_traceback: str = "", rank: int | None = None) -> None:
        super().__init__(message)
        self.worker_traceback = worker_traceback
        self.rank = rank


class WorkerRaised:
    """Mixed into the type a worker raised (``except ValueError`` still catches it): where it was raised.

    IPython shows the worker's traceback, not the notebook's (as ipyparallel shows a RemoteError)."""

    worker_traceback: str = ""
    rank: int | None = None

    def _render_traceback_(self) -> list[str]:
        head = f"--- raised on worker {self.rank} ---" if self.rank is not None else "--- raised on a worker ---"
        notes = [str(n) for n in getattr(self, "__notes__", ())]
        return [head, *self.worker_traceback.rstrip().splitlines(), *notes]


_RAISED_TYPES: dict[type, type] = {}


def worker_raised(base: type[BaseException], *args: Any, worker_traceback: str, rank: int | None) -> BaseException:
    """An exception of type ``base`` (built from ``args``) that is also ``WorkerRaised``; named as ``base`` is."""
    kind = _RAISED_TYPES.get(base)
    if kind is None:
        kind = type(base.__name__, (base, WorkerRaised), {"__module__": base.__module__,
                                                         "__qualname__": base.__qualname__})
        _RAISED_TYPES[base] = kind
    exc = kind(*args)
    exc.worker_traceback = worker_traceback
    exc.rank = rank
    return exc
