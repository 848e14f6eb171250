"""Exceptions a user sees.

nbdist's own failures (bad input, an unusable environment, a worker that died or timed out) are
``NbdistError`` / ``TrainingFailed``: one sentence naming the problem and the fix. What Keras, TensorFlow
or the cell's own code raises is raised again as itself: an exception of a notebook callback propagates
unchanged, and one raised on a worker comes back as exactly its own type with its own message, carrying
``worker_traceback`` and ``rank``, shown as IPython shows a remote error.
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


class _RemoteTraceback:
    """What IPython shows for an exception raised on a worker: the worker's traceback, not the notebook's
    (as ipyparallel shows a RemoteError). A class, not a closure, so the exception still pickles."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __call__(self) -> list[str]:
        rank = getattr(self.exc, "rank", None)
        head = f"--- raised on worker {rank} ---" if rank is not None else "--- raised on a worker ---"
        notes = [str(n) for n in getattr(self.exc, "__notes__", ())]
        return [head, *str(getattr(self.exc, "worker_traceback", "")).rstrip().splitlines(), *notes]


def worker_raised(base: type[BaseException], *args: Any, worker_traceback: str, rank: int | None) -> BaseException:
    """An exception of exactly type ``base`` (built from ``args``), as the worker raised it, carrying where:
    ``worker_traceback`` and ``rank``, and the ``_render_traceback_`` IPython uses to show it."""
    exc = base(*args)
    exc.worker_traceback = worker_traceback  # type: ignore[attr-defined]
    exc.rank = rank  # type: ignore[attr-defined]
    exc._render_traceback_ = _RemoteTraceback(exc)  # type: ignore[attr-defined]
    return exc


def raised_on_worker(exc: BaseException) -> bool:
    """Whether ``exc`` is a worker's exception rebuilt in the notebook (``worker_raised``)."""
    return hasattr(exc, "worker_traceback") and not isinstance(exc, TrainingFailed)
