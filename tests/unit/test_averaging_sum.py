"""One averaging round is ONE sum of (samples * weights, samples): the weighted average, in one exchange."""
from __future__ import annotations

import numpy as np

from nbdist.strategies.averaging import WeightedAverager


class Var:
    """A variable as the averager sees one: numpy() and assign()."""

    def __init__(self, value: list) -> None:
        self.value = np.array(value, dtype=np.float32)
        self.shape = self.value.shape

    def numpy(self) -> np.ndarray:
        return self.value

    def assign(self, value: np.ndarray) -> None:
        self.value = np.array(value, dtype=np.float32).reshape(self.shape)


class PeerSum:
    """Rank 0 of two: each sum adds what the peer contributes (its weights times its samples, then its samples)."""

    rank, world_size = 0, 2

    def __init__(self, peer_weights: list[list], peer_samples: int) -> None:
        flat = np.concatenate([np.ravel(np.array(w, dtype=np.float32)) for w in peer_weights])
        self.peer = np.concatenate([flat * peer_samples, [peer_samples]]).astype(np.float32)
        self.calls = 0

    def allreduce_sum(self, buf: np.ndarray) -> None:
        self.calls += 1
        buf += self.peer


def test_one_sum_per_round_gives_the_sample_weighted_average():
    mine = [Var([[1.0, 2.0]]), Var([10.0])]
    peer = PeerSum([[[4.0, 8.0]], [40.0]], peer_samples=1)
    averager = WeightedAverager(peer, mine)
    assert averager.average(3) == 4
    assert peer.calls == 1  # the count travels with the weights: no separate count allreduce
    np.testing.assert_allclose(mine[0].value, [[1.75, 3.5]], rtol=1e-6)  # (3 * mine + 1 * peer) / 4
    np.testing.assert_allclose(mine[1].value, [17.5], rtol=1e-6)
    assert averager.rounds == 1 and averager.summed_by == "allreduce"


def test_a_worker_without_samples_takes_the_average_and_an_empty_round_changes_nothing():
    mine = [Var([100.0, 100.0])]
    assert WeightedAverager(PeerSum([[2.0, 4.0]], 5), mine).average(0) == 5  # my shard ran out
    np.testing.assert_allclose(mine[0].value, [2.0, 4.0], rtol=1e-6)
    mine = [Var([7.0, 9.0])]
    assert WeightedAverager(PeerSum([[1.0, 1.0]], 0), mine).average(0) == 0  # nobody trained
    np.testing.assert_array_equal(mine[0].value, [7.0, 9.0])
