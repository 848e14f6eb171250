"""What the driver tells its workers after their job (wire/messages.py), and the heartbeat both sides send."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .codec import MessageType, Typed, arrays


@dataclass(frozen=True)
class Decision(Typed):
    """The notebook's callbacks at an epoch's end: stop? the learning rate for the next epoch (None: as is)."""

    TYPE = MessageType.DECISION
    epoch: int
    stop: bool
    learning_rate: float | None = None


@dataclass(frozen=True)
class Rendezvous(Typed):
    """Where rank 0's store listens (or the directory the workers of one machine meet in), relayed to every worker."""

    TYPE = MessageType.RENDEZVOUS
    host: str
    port: int
    path: str = ""


@dataclass(frozen=True)
class Stop(Typed):
    """End now; ``weights``: rank 0 first sends its last epoch's weights (they travel only at the end)."""

    TYPE = MessageType.STOP
    weights: bool = False


@dataclass(frozen=True)
class JoinAtCommit(Typed):
    """An elastic run: workers wait to join (driver/membership.py). Generation ``generation`` ends at its next
    commit after the one it started from; its members agree over their collective to stop there together and
    report ``AtCommit`` (worker/elastic.py ``JoinPoint``). One of an older generation is ignored."""

    TYPE = MessageType.JOIN_AT_COMMIT
    generation: int


@dataclass(frozen=True)
class GenerationBroken(Typed):
    """An elastic run: a member of generation ``generation`` is gone (ended, or silent past heartbeat_timeout). Its
    members leave whatever collective they wait in, report ``Lost`` and wait for the next generation's job
    (worker/elastic.py). One of an older generation is ignored."""

    TYPE = MessageType.GENERATION_BROKEN
    generation: int


@dataclass(frozen=True)
class AsyncShared(Typed):
    """--strategy async: the shared weights and their version, and the worker's next block of batches, or
    ``epoch_done`` (no batches) once the epoch's every batch was trained; ``refused``: why the worker's last
    push was not applied ("" when it was)."""

    TYPE = MessageType.ASYNC_SHARED
    version: int
    batches: list[int]
    epoch_done: bool
    refused: str = ""
    weights: list[np.ndarray] = arrays()


@dataclass(frozen=True)
class Heartbeat(Typed):
    TYPE = MessageType.HEARTBEAT
