"""Every message type by its wire name, and ``decode_message``: any message of either direction, typed."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import commands, reports
from .codec import MessageError, MessageType
from .messages import JobMessage

TYPES: dict[str, Any] = {cls.TYPE.value: cls for cls in (
    reports.Hello, reports.Store, reports.Progress, reports.State, reports.Epoch, reports.Weights, reports.Done,
    reports.WorkerError, reports.Lost, reports.AtCommit, reports.WorkerWarning, reports.AsyncPull, reports.AsyncPush,
    reports.Evaluation, reports.Predictions, reports.TaskStarted, reports.TaskRows, reports.TaskExit,
    commands.Decision, commands.Rendezvous, commands.Stop, commands.JoinAtCommit, commands.GenerationBroken,
    commands.AsyncShared, commands.Heartbeat)}
TYPES[MessageType.JOB.value] = JobMessage


def decode_message(body: Any, arrays: list[np.ndarray]) -> Any:
    """The typed message from an authenticated body and its arrays; MessageError in one line for an unknown
    type or a malformed message (a missing, unknown or mistyped field, a wrong number of arrays)."""
    kind = body.get("type") if isinstance(body, dict) else None
    cls = TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MessageError(f"unknown message type {str(kind)[:40]!r}")
    return cls.decode(body, arrays)


def read(message: Any) -> Any:
    """``decode_message`` of a received ``protocol.Message``."""
    return decode_message(message.body, message.arrays)
