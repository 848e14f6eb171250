"""Exceptions a user sees. Each carries one sentence naming the problem and the fix."""
from __future__ import annotations


class NbdistError(Exception):
    """Bad input or an unusable environment: shown as one sentence, never a traceback."""


class TrainingFailed(NbdistError):
    """A worker failed; ``worker_traceback`` holds the traceback from the worker itself."""

    def __init__(self, message: str, worker_traceback: str = "", rank: int | None = None) -> None:
        super().__init__(message)
        self.worker_traceback = worker_traceback
        self.rank = rank
