"""What every message shares: its name on the wire, the error for one this side cannot read, and how a
typed message becomes a JSON body plus arrays and back.

A message type is a frozen dataclass deriving from ``Typed``, with ``TYPE`` its ``MessageType``. Its JSON
fields are checked against their annotations when read (``int``, ``float``, ``str``, ``bool``, ``Any``
for any JSON value, ``X | None``, ``list[X]``, ``dict[str, X]``); its arrays are the fields declared with
``arrays()`` (a list) or ``array()`` (one, or None), sent in field order after the body, whose
``"arrays"`` entry says how many each field has. So each type owns its array layout: no side counts
positions on its own. ``decode`` raises ``MessageError`` in one line for a missing, unknown or mistyped
field or a wrong array count, never another exception.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import types
import typing
from typing import Any, ClassVar, Self

import numpy as np

ARRAYS_KEY = "arrays"  # the body's entry with each array field's count
_ARRAY_META = "nbdist_arrays"  # dataclass field metadata: "list" or "one"


class MessageType(enum.StrEnum):
    """Every ``body["type"]`` on the wire. A StrEnum: it is the string in JSON and compares equal to it."""

    # worker -> driver (wire/reports.py)
    HELLO = "hello"  # first message: rank, pid, host
    STORE = "store"  # rank 0's Gloo store listens here (host, port)
    PROGRESS = "progress"  # batch / epoch position and timing
    STATE = "state"  # a sampled phase: training or synchronising (worker/phases.py)
    EPOCH = "epoch"  # an epoch's metrics on this worker's shard
    WEIGHTS = "weights"  # rank 0's synchronised weights and optimizer state after an epoch
    DONE = "done"  # finished; the body is the worker's closing report
    ERROR = "error"  # failed: the exception's type, one line and the traceback
    WARNING = "warning"  # something worth saying once, not fatal
    LOST = "lost"  # an elastic run: this worker's collective broke; it waits for the driver's new generation
    AT_COMMIT = "at_commit"  # an elastic run: this worker stopped at its commit for joiners, as asked; it waits too
    ASYNC_PULL = "async_pull"  # --strategy async: the shared weights and a block of batches, please
    ASYNC_PUSH = "async_push"  # --strategy async: a block's delta (seq, the version it started from, samples)
    EVALUATION = "evaluation"  # a shard's additive metric state
    PREDICTIONS = "predictions"  # a shard's predictions, rows in order
    # driver -> worker (wire/messages.py: the job; wire/commands.py: the rest)
    JOB = "job"  # the JobMessage
    DECISION = "decision"  # the notebook's callbacks at an epoch's end: stop? the next learning rate
    RENDEZVOUS = "rendezvous"  # where rank 0's store listens, relayed to every worker
    STOP = "stop"  # end now
    JOIN_AT_COMMIT = "join_at_commit"  # an elastic run: workers wait to join; stop together at the next commit
    GENERATION_BROKEN = "generation_broken"  # an elastic run: a member is gone; leave the generation's collective
    ASYNC_SHARED = "async_shared"  # --strategy async: the shared weights, their version, the next block
    # both ways
    HEARTBEAT = "heartbeat"
    # a Spark barrier task -> the Spark backend's status server (spark/task.py, spark/backend.py)
    TASK_STARTED = "started"
    TASK_ROWS = "rows"  # the rows of the partition the task wrote for its worker
    TASK_EXIT = "exit"


class MessageError(ValueError):
    """A message this side cannot read: another version, or malformed. Always one line: it quotes what the
    peer sent, which may hold newlines."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


def arrays() -> Any:
    """A field holding a list of arrays (sent after the body, in field order)."""
    return dataclasses.field(default_factory=list, metadata={_ARRAY_META: "list"})


def array() -> Any:
    """A field holding one array or None."""
    return dataclasses.field(default=None, metadata={_ARRAY_META: "one"})


class Typed:
    """The base of every typed message but the job (wire/messages.py), which encodes its model by hand."""

    TYPE: ClassVar[MessageType]

    def check(self) -> None:
        """Relations between fields a decoded message must hold; raise MessageError."""

    def encode(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        """The JSON body and the arrays, in the order ``decode`` reads them back."""
        body: dict[str, Any] = {"type": self.TYPE.value}
        out: list[np.ndarray] = []
        counts: dict[str, int] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            how = f.metadata.get(_ARRAY_META)
            if how == "list":
                counts[f.name] = len(value)
                out.extend(value)
            elif how == "one":
                counts[f.name] = int(value is not None)
                if value is not None:
                    out.append(value)
            else:
                body[f.name] = value
        if counts:
            body[ARRAYS_KEY] = counts
        return body, out

    @classmethod
    def decode(cls, body: dict[str, Any], arrays: list[np.ndarray]) -> Self:
        """The message from an authenticated body and its arrays; MessageError in one line if malformed."""
        name = cls.TYPE.value
        if not isinstance(body, dict) or body.get("type") != cls.TYPE:
            raise MessageError(f"expected a {name} message")
        values: dict[str, Any] = {}
        hints = _hints(cls)
        fields = dataclasses.fields(cls)  # type: ignore[arg-type]
        listed = {f.name for f in fields if _ARRAY_META not in f.metadata}
        unknown = set(body) - listed - {"type", ARRAYS_KEY}
        if unknown:
            shown = ", ".join(sorted(repr(k)[:40] for k in unknown)[:5])
            raise MessageError(f"a {name} message has unknown field(s) {shown}")
        for f in fields:
            if f.name not in listed:
                continue
            if f.name in body:
                values[f.name] = _conform(body[f.name], hints[f.name], f"{name}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"a {name} message lacks its field {f.name}")
        values.update(_take_arrays(cls, body, list(arrays)))
        try:
            message = cls(**values)
        except (TypeError, ValueError) as exc:  # a type's own __post_init__ refusing a value
            raise MessageError(f"malformed {name} message: {exc}") from None
        message.check()
        return message


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _take_arrays(cls: type[Typed], body: dict[str, Any], pending: list[np.ndarray]) -> dict[str, Any]:
    name = cls.TYPE.value
    layout = [(f.name, f.metadata[_ARRAY_META]) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
              if _ARRAY_META in f.metadata]
    counts = body.get(ARRAYS_KEY, {})
    if not isinstance(counts, dict) or set(counts) != {field for field, _ in layout}:
        raise MessageError(f"a {name} message describes its arrays as {repr(counts)[:80]}, not by "
                           f"{', '.join(field for field, _ in layout) or 'nothing'}")
    out: dict[str, Any] = {}
    for field, how in layout:
        n = counts[field]
        if type(n) is not int or n < 0 or (how == "one" and n > 1):
            raise MessageError(f"a {name} message has a bad array count for {field}: {repr(n)[:40]}")
        if n > len(pending):
            raise MessageError(f"a {name} message has fewer arrays than its body describes")
        taken, pending[:n] = pending[:n], []
        out[field] = taken if how == "list" else (taken[0] if taken else None)
    if pending:
        raise MessageError(f"a {name} message has {len(pending)} more arrays than its body describes")
    return out


def _conform(value: Any, hint: Any, where: str) -> Any:
    """``value`` read from JSON as ``hint`` says (an int where a float is wanted becomes a float)."""
    if hint is Any:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _conform(value, arg, where)
            except MessageError:
                continue
        raise _wrong(value, hint, where)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, list):
            return [_conform(v, args[0], where) for v in value]
    elif origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {k: _conform(v, args[1], where) for k, v in value.items()}
    else:
        raise TypeError(f"{where}: no wire check for {hint!r}")  # a message type declared a field we cannot read
    raise _wrong(value, hint, where)


def _wrong(value: Any, hint: Any, where: str) -> MessageError:
    shown = repr(value)
    return MessageError(f"malformed message: {where} is {shown[:40]}{'...' if len(shown) > 40 else ''}, "
                        f"not {getattr(hint, '__name__', None) or str(hint).replace('typing.', '')}")
