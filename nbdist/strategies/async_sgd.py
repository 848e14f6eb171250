"""Asynchronous local SGD against a shared model: the rule of ``--strategy async`` (pure, no sockets).

The driver serves it (driver/async_server.py), the workers train against it (worker/async_fit.py): each
worker trains K local steps from the shared weights it pulled and sends its delta, without waiting for others.
The rule: ``shared += delta / N / (1 + max(0, staleness - (N - 1)))`` (``staleness_scale``); deltas staler
than ``max_staleness`` (default 4 N) and replayed sequence numbers are refused. With equal workers a round of
N deltas is exactly an averaging round. Optimizer state stays on each worker; a run is not reproducible bit
for bit (arrival order depends on timing).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def default_max_staleness(world_size: int) -> int:
    return 4 * world_size


def staleness_scale(staleness: int, world_size: int) -> float:
    """The factor a delta computed ``staleness`` versions ago is applied with (its 1/N share included)."""
    excess = max(0, staleness - (world_size - 1))
    return 1.0 / world_size / (1.0 + excess)


@dataclass(frozen=True)
class Verdict:
    """What the server did with one pushed delta."""

    applied: bool
    version: int  # the shared version after it
    staleness: int = 0
    scale: float = 0.0
    reason: str = ""  # why it was refused


class SharedModel:
    """The shared weights, their version, and each worker's last applied sequence number, under the module's
    rule. Not thread-safe: the driver applies pushes one at a time from its event loop.

    Staleness is the versions applied since the delta's base. Scaled by 1/N, a round of N deltas from one base is
    a synchronous averaging round, so a slow worker slows only its own contribution. Staleness up to N - 1 is what
    every worker of a synchronous round absorbs too and is not penalised; beyond it, Zhang et al.'s rate /
    staleness damps the delta; beyond ``max_staleness`` it is refused (the worker pulls and goes on, its block
    lost). A sequence number not above the worker's last is refused: the wire's HMAC and per-frame sequence
    refuse forged and replayed frames, this a replayed update inside them. The local learning rate follows
    ``--lr-scaling`` as under allreduce, so with each delta counted 1/N the shared model moves as much per sample
    as allreduce's. Optimizer state stays local (Adam's moments describe one worker's trajectory).
    """

    def __init__(self, weights: Sequence[np.ndarray], world_size: int, max_staleness: int | None = None) -> None:
        if world_size < 1:
            raise ValueError("world_size must be at least 1")
        self.weights = [np.array(w, dtype=np.float32, copy=True) for w in weights]
        self.world_size = world_size
        self.max_staleness = default_max_staleness(world_size) if max_staleness is None else max_staleness
        self.version = 0
        self.samples = 0  # samples behind the applied deltas
        self.refused = 0
        self._last_seq = [-1] * world_size

    def pull(self) -> tuple[int, list[np.ndarray]]:
        """The version and the weights a worker continues from (the arrays themselves: send, do not keep)."""
        return self.version, self.weights

    def push(self, rank: int, seq: int, base_version: int, delta: Sequence[np.ndarray], samples: int) -> Verdict:
        refusal = self._refusal(rank, seq, base_version, delta, samples)
        if refusal:
            self.refused += 1
            return Verdict(False, self.version, reason=refusal)
        staleness = self.version - base_version
        scale = staleness_scale(staleness, self.world_size)
        for w, d in zip(self.weights, delta):
            w += np.float32(scale) * d.astype(np.float32, copy=False)
        self._last_seq[rank] = seq
        self.version += 1
        self.samples += samples
        return Verdict(True, self.version, staleness, scale)

    def _refusal(self, rank: int, seq: int, base_version: int, delta: Sequence[np.ndarray], samples: int) -> str:
        if not 0 <= rank < self.world_size:
            return f"rank {rank} is not a worker of this run"
        if seq <= self._last_seq[rank]:
            return f"worker {rank}'s update {seq} replays one at or before {self._last_seq[rank]}"
        if not 0 <= base_version <= self.version:
            return f"worker {rank}'s update starts from version {base_version}, which the server never had"
        if self.version - base_version > self.max_staleness:
            return (f"worker {rank}'s update is {self.version - base_version} versions stale, over the bound "
                    f"of {self.max_staleness}")
        if samples < 0:
            return f"worker {rank}'s update claims {samples} samples"
        if len(delta) != len(self.weights) or any(d.shape != w.shape for d, w in zip(delta, self.weights)):
            return f"worker {rank}'s update does not have the model's shapes"
        if not all(np.isfinite(d).all() for d in delta):
            return f"worker {rank}'s update is not finite (diverged)"
        return ""


class BatchPool:
    """An epoch's batches dealt K at a time to whichever worker asks, so a fast worker takes more of them.

    ``order`` is the epoch's batch order (shuffled by the caller). An epoch is complete when every batch
    was dealt and every dealt block was reported back (pushed or refused): only then does a worker start
    the next one, so every epoch's metrics and callbacks see all of its data once.

    Data (worker/async_batches.py): the driver deals batch indices, K at a time, to whichever worker is free,
    so a block's message is a few integers whatever the data. A PyDataset's batches are its own. In-memory
    arrays (x, y, sample_weight or class_weight, validation_data or validation_split, as for fit) go whole to
    every worker once, in its job (a local worker maps the notebook's ``np.load(..., mmap_mode="r")`` .npy
    instead); batch i of an epoch is rows ``order[i*u:(i+1)*u]``, ``order`` the epoch's shuffled rows (the
    run's seed, the same on every worker) and ``u`` one worker's share of fit's global batch (``--batch-size``
    itself with ``--data``). Refused in one sentence: a Spark DataFrame or RDD (it stays on its executors),
    steps_per_epoch short of a pass, PyDataset validation data, checkpoints and restarts. Tested on the
    TensorFlow, JAX and torch backends, local processes, Spark tasks, containers and ``%%dist_tune`` trials.
    """

    def __init__(self, order: Sequence[int]) -> None:
        self.order = list(order)
        self._next = 0
        self._out: dict[int, int] = {}  # rank -> batches dealt and not yet reported

    def deal(self, rank: int, k: int, workers: int = 1) -> list[int]:
        """Up to ``k`` batches; fewer near the epoch's end (the rest shared over ``workers``), so the last
        block of a slow worker, which every worker waits for at the epoch's end, is short."""
        if self._out.get(rank):
            raise ValueError(f"worker {rank} asked for batches before reporting its last block")
        k = max(1, min(k, self.left // max(1, workers)))
        block = self.order[self._next:self._next + k]
        self._next += len(block)
        if block:
            self._out[rank] = len(block)
        return block

    def report(self, rank: int) -> None:
        self._out.pop(rank, None)

    @property
    def left(self) -> int:
        return len(self.order) - self._next

    @property
    def complete(self) -> bool:
        return self._next >= len(self.order) and not self._out


def block_cap(left: int, rank: int, rates: dict[int, float], world_size: int) -> int:
    """The most batches worth dealing ``rank`` of the ``left`` in the epoch: its share of them by its measured
    speed (batches/s), so every worker's last block ends at about the same time and the fast ones wait
    little for the slow one at the epoch's end; before every worker's speed is known, an equal share."""
    if len(rates) == world_size and rates.get(rank, 0.0) > 0:
        return max(1, math.ceil(left * rates[rank] / sum(rates.values())))
    return max(1, left // world_size)
