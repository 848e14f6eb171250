"""Parameter averaging: every K mini-batches, a sample-weighted average of weights.

Workers may hold shards with different numbers of batches. Collectives must
pair up across workers, so every worker performs the same number of rounds per
epoch: one every K batches, one at its last batch, and then empty rounds
(contributing zero samples, receiving the average) until it has done as many as
the worker with the most batches. Every worker therefore ends each epoch -- and
starts validation -- with identical weights.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .collective import Collective


def rounds_in_epoch(batches: int, k: int) -> int:
    return -(-batches // k)


def rounds_per_epoch(batches_per_worker: Sequence[int], k: int) -> int:
    return max(rounds_in_epoch(b, k) for b in batches_per_worker)


def batch_sizes(samples: int, batch_size: int) -> list[int]:
    full, rest = divmod(samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def sync_after(batch: int, batches: int, k: int) -> bool:
    """Whether a worker with ``batches`` batches averages after 0-based ``batch``."""
    return (batch + 1) % k == 0 or batch == batches - 1


class FlatBuffer:
    """Variables packed into one contiguous float32 buffer, so one allreduce moves them all."""

    def __init__(self, variables: Sequence[Any]) -> None:
        self.variables = list(variables)
        self.shapes = [tuple(v.shape) for v in self.variables]
        sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self.buffer = np.zeros(int(self.offsets[-1]), dtype=np.float32)

    def gather(self, scale: float = 1.0) -> np.ndarray:
        for v, a, b in zip(self.variables, self.offsets[:-1], self.offsets[1:]):
            np.multiply(np.asarray(v.numpy(), dtype=np.float32).reshape(-1), scale, out=self.buffer[a:b])
        return self.buffer

    def scatter(self) -> None:
        for v, shape, a, b in zip(self.variables, self.shapes, self.offsets[:-1], self.offsets[1:]):
            v.assign(self.buffer[a:b].reshape(shape))


class WeightedAverager:
    """One averaging round: weights scaled by this worker's share of the samples, then summed."""

    def __init__(self, collective: Collective, variables: Sequence[Any]) -> None:
        self.collective = collective
        self.flat = FlatBuffer(variables)
        self._count = np.zeros(1, dtype=np.float64)
        self.seconds = 0.0
        self.rounds = 0

    def average(self, samples: int) -> int:
        """Average with every worker; ``samples`` is what this worker trained on since the last round."""
        if self.collective.world_size == 1:
            return samples
        t0 = time.perf_counter()
        self._count[0] = samples
        self.collective.allreduce_sum(self._count)
        total = int(self._count[0])
        if total > 0:
            if samples:
                self.flat.gather(samples / total)
            else:
                self.flat.buffer.fill(0.0)
            self.collective.allreduce_sum(self.flat.buffer)
            self.flat.scatter()
        self.seconds += time.perf_counter() - t0
        self.rounds += 1
        return total
