"""Metric sums over workers check once that every worker holds the same metric variables."""
from __future__ import annotations

import numpy as np
import pytest

from nbdist.worker.fit_sync import MetricStateSum

from ..conftest import mlp


class Peer:
    """Rank 0 of two; the peer adds ``extra`` more values to the size check than this worker has."""

    rank, world_size = 0, 2

    def __init__(self, extra: int) -> None:
        self.extra = extra
        self.calls = 0

    def allreduce_sum(self, buf: np.ndarray) -> None:
        self.calls += 1
        buf += buf + (self.extra if buf.size == 1 and self.calls == 1 else 0)


def test_workers_with_different_metrics_fail_at_the_first_sum_and_equal_ones_sum(digits):
    x, y = digits
    model = mlp()
    model.fit(x[:64], y[:64], epochs=1, verbose=0)
    with pytest.raises(RuntimeError, match="different metric variables"):
        MetricStateSum(Peer(extra=3), model).sum()
    peer = Peer(extra=0)
    before = [v.numpy().copy() for v in MetricStateSum(peer, model).variables()]
    summer = MetricStateSum(peer, model)
    summer.sum()
    summer.sum()
    after = [v.numpy() for v in summer.variables()]
    for a, b in zip(before, after):
        np.testing.assert_allclose(b, 4 * a, rtol=1e-6)  # each sum doubled them (the peer holds the same)
