"""Sparse gradients under allreduce (strategies/sparse_grads.py), in-process: how a traced gradient's lookups
are told per row or broadcast, and the slices two ranks' exchange hands Keras (the ranks are two threads
summing through a barrier; the real workers are in tests/workers/test_embeddings.py)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from nbdist.strategies.sparse_grads import SliceExchange, from_batch, segments  # noqa: E402


def traced_kinds(lookups) -> tuple[bool, ...]:
    """Each segment's kind in the gradient of a table looked up by ``lookups(table, ids)``, traced."""
    table = tf.Variable(tf.ones((20, 3)))
    kinds = []

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(lookups(table, ids))
        grad = tape.gradient(loss, table)
        assert isinstance(grad, tf.IndexedSlices)
        kinds.extend(from_batch(s) for s in segments(grad.indices))
        return grad.values

    step(tf.constant([[1, 2, 3], [4, 5, 6]]))
    return tuple(kinds)


def test_lookups_on_the_batch_are_per_row_and_on_positions_broadcast():
    take = keras.ops.take
    assert traced_kinds(lambda t, ids: take(t, ids, axis=0)) == (True,)
    assert traced_kinds(lambda t, ids: take(t, (ids * 2) % 20, axis=0)) == (True,)  # computed from the values
    assert traced_kinds(lambda t, ids: take(t, keras.ops.arange(3), axis=0)) == (False,)
    # keras.io's positions: arange over the batch's own length depends on its shape only
    assert traced_kinds(lambda t, ids: take(t, keras.ops.arange(tf.shape(ids)[-1]), axis=0)) == (False,)
    # one table, two lookups in one step: two segments, in the tape's order
    both = lambda t, ids: tf.reduce_sum(take(t, ids, axis=0)) + tf.reduce_sum(take(t, tf.range(3), axis=0))
    kinds = traced_kinds(both)
    assert sorted(kinds) == [False, True]


class PairSum:
    """Two ranks in two threads: ``allreduce_sum`` adds both ranks' arrays in place."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=30)
        self.slots: list[np.ndarray | None] = [None, None]

    def rank(self, r: int):
        pair = self

        class Rank:
            rank, world_size = r, 2

            def allreduce_sum(self, buf: np.ndarray) -> None:
                pair.slots[r] = buf.copy()
                pair.barrier.wait()
                total = pair.slots[0] + pair.slots[1]
                pair.barrier.wait()
                buf[...] = total

        return Rank()


def test_exchange_joins_per_row_slices_in_rank_order_and_sums_broadcast_ones():
    pair = PairSum()
    layout = ((True, False),)  # one table: a per-row lookup, then a lookup on positions 0..1
    # rank r: 2 rows of ids [r, 5] (5 on both ranks), then its batch's sums for positions 0 and 1
    arrays = [[np.array([0, 5, 0, 1]), np.array([[1.0], [2.0], [10.0], [20.0]], "float32"), np.array([2, 2])],
              [np.array([1, 5, 0, 1]), np.array([[3.0], [4.0], [30.0], [40.0]], "float32"), np.array([2, 2])]]
    out: list = [None, None]

    def run(r: int, rows: float) -> None:
        exchange = SliceExchange(pair.rank(r))
        exchange.layout = layout
        out[r] = exchange.exchange(arrays[r], rows, 0.5)

    threads = [threading.Thread(target=run, args=(r, 2.0)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    for indices, values in (out[0], out[1]):
        np.testing.assert_array_equal(indices, [0, 5, 1, 5, 0, 1])
        np.testing.assert_allclose(values[:, 0], [0.5, 1.0, 1.5, 2.0, 20.0, 30.0])


def test_a_pad_step_adds_no_slices():
    pair = PairSum()
    layout = ((True, False),)
    arrays = [np.array([7, 0, 1]), np.array([[1.0], [10.0], [20.0]], "float32"), np.array([1, 2])]
    empty = [np.zeros(0, np.int64), np.zeros((0, 1), "float32"), np.array([0, 0])]
    out: list = [None, None]

    def run(r: int) -> None:
        exchange = SliceExchange(pair.rank(r))
        exchange.layout = layout
        out[r] = exchange.exchange(arrays if r == 0 else empty, 1.0 if r == 0 else 0.0, None)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(30) for t in threads]
    for indices, values in out:
        np.testing.assert_array_equal(indices, [7, 0, 1])
        np.testing.assert_allclose(values[:, 0], [1.0, 10.0, 20.0])
