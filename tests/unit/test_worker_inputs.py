"""The worker's input pipeline (worker/datasets.py) and core slicing (placement.core_slices), in-process.

The pipeline must give exactly Keras' batches (the averaging and allreduce callbacks count
them with ``batch_sizes``), one pass per epoch, and fit must train and validate as before.
"""
from __future__ import annotations

import numpy as np
import pytest

from nbdist.machine.placement import core_slices, shared_core_slices
from nbdist.strategies.averaging import batch_sizes
from nbdist.worker.datasets import epoch_steps, fit_inputs, fit_steps, repeated_batches, sample_count, shuffle_seed


def test_step_counts_are_full_batches_plus_the_short_one():
    assert epoch_steps(64, 32) == 2 and epoch_steps(65, 32) == 3 and epoch_steps(1, 32) == 1
    for n in (1, 31, 32, 33, 899):
        assert epoch_steps(n, 16) == len(batch_sizes(n, 16))
    assert fit_steps(100, 0, 32) == (4, None)
    assert fit_steps(100, 33, 32) == (4, 2)
    with pytest.raises(ValueError):
        epoch_steps(0, 32)  # steps_per_epoch=0 would mean "forever" on a repeated dataset


def test_shuffle_seed_follows_the_workers_keras_seed():
    assert shuffle_seed(7, 0) == 7 and shuffle_seed(7, 3) == 10
    assert shuffle_seed(None, 0) != shuffle_seed(None, 0)  # unseeded: a fresh one per fit
    assert sample_count(np.zeros((5, 2))) == 5
    assert sample_count([np.zeros((4, 2)), np.zeros((4,))]) == 4
    assert sample_count({"a": np.zeros((3, 1))}) == 3


def epochs_of(ds, n: int, batch: int, epochs: int) -> list[list[np.ndarray]]:
    """``epochs`` passes of a repeated dataset, split into epochs by the step count."""
    steps = epoch_steps(n, batch)
    it = iter(ds)
    return [[next(it) for _ in range(steps)] for _ in range(epochs)]


def test_unshuffled_batches_are_keras_batches_every_epoch():
    n, b = 70, 16
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    y = np.arange(n)
    for epoch in epochs_of(repeated_batches(x, y, b, shuffle=False), n, b, 3):
        assert [len(by) for _, by in epoch] == batch_sizes(n, b)
        np.testing.assert_array_equal(np.concatenate([by for _, by in epoch]), y)
        np.testing.assert_array_equal(np.concatenate([bx for bx, _ in epoch]), x)


def test_shuffled_epochs_are_fresh_permutations_with_the_short_batch_last():
    n, b = 70, 16
    x = np.arange(n, dtype=np.float32)[:, None] * 10
    y = np.arange(n)
    epochs = epochs_of(repeated_batches(x, y, b, shuffle=True, seed=5), n, b, 4)
    orders = []
    for epoch in epochs:
        assert [len(by) for _, by in epoch] == batch_sizes(n, b)
        order = np.concatenate([by for _, by in epoch])
        np.testing.assert_array_equal(np.sort(order), y)  # one pass: every sample exactly once
        np.testing.assert_array_equal(np.concatenate([bx for bx, _ in epoch])[:, 0], order * 10)  # rows stay paired
        orders.append(order.tolist())
    assert len({tuple(o) for o in orders}) == 4 and orders[0] != y.tolist()
    # Resumed at epoch 2, a worker sees the order the uninterrupted run had in its epoch 2.
    resumed = epochs_of(repeated_batches(x, y, b, shuffle=True, seed=5, first_epoch=2), n, b, 2)
    assert [np.concatenate([by for _, by in e]).tolist() for e in resumed] == orders[2:]


def test_no_targets_gives_features_only():
    x = np.arange(10, dtype=np.float32)[:, None]
    (first,) = epochs_of(repeated_batches(x, None, 4, shuffle=False), 10, 4, 1)
    assert [tuple(t.shape) for t in first] == [(4, 1), (4, 1), (2, 1)]


def test_fit_on_the_pipeline_equals_fit_on_arrays(digits):
    """Same weights, losses and validation metrics as ``fit(x, y, batch_size, shuffle=False)``."""
    import keras

    x, y = digits[0][:300], digits[1][:300]
    xv, yv = digits[0][300:401], digits[1][300:401]  # 101 rows: a short validation batch too

    def trained(**data):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
        history = model.fit(**data, epochs=3, verbose=0)
        return model.get_weights(), history.history, model.evaluate(xv, yv, batch_size=32, verbose=0)

    want_w, want_h, evaluated = trained(x=x, y=y, batch_size=32, shuffle=False, validation_data=(xv, yv))
    got_w, got_h, _ = trained(**fit_inputs(x, y, 32, False, None, 0, 0, (xv, yv)))
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    assert set(got_h) == set(want_h)
    for key in want_h:
        assert got_h[key] == pytest.approx(want_h[key], rel=1e-6), key
    assert got_h["val_loss"][-1] == pytest.approx(evaluated[0], rel=1e-6)  # validation stays exact


def test_a_model_without_targets_trains_on_features_alone():
    """A loss that needs no targets (add_loss): ``has_y`` is false, the pipeline yields x only."""
    import keras

    class ActivityPenalty(keras.layers.Layer):
        def call(self, inputs):
            self.add_loss(keras.ops.mean(keras.ops.square(inputs - 1.0)))
            return inputs

    x = np.random.default_rng(0).random((50, 4), dtype=np.float32)

    def trained(**data):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), ActivityPenalty()])
        model.compile(keras.optimizers.SGD(0.1))
        history = model.fit(**data, epochs=2, verbose=0)
        return model.get_weights(), history.history["loss"]

    want_w, want_loss = trained(x=x, batch_size=16, shuffle=False)
    got_w, got_loss = trained(**fit_inputs(x, None, 16, False, None, 0, 0, None))
    for g, w in zip(got_w, want_w):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    assert got_loss == pytest.approx(want_loss, rel=1e-6)


def test_core_slices_bind_each_worker_to_its_own_cores():
    assert core_slices({0, 1}, 2, 1) == [{0}, {1}]
    assert core_slices({0, 1}, 1, 2) == [{0, 1}]
    assert core_slices(range(8), 2, 4) == [{0, 1, 2, 3}, {4, 5, 6, 7}]
    assert core_slices([7, 3, 5, 1], 2, 2) == [{1, 3}, {5, 7}]  # contiguous in the allowed set, not in ids
    assert core_slices(range(5), 2, 2) == [{0, 1}, {2, 3}]  # the odd core stays free (the driver uses it)
    assert core_slices(range(4), 2, 8) == [{0, 1}, {2, 3}]  # never more than an even share
    assert core_slices({0, 1}, 3, 1) is None  # more workers than cores: the scheduler shares them
    assert core_slices({4}, 1, 1) == [{4}]
    with pytest.raises(ValueError):
        core_slices({0, 1}, 0, 1)


def test_runs_sharing_the_machine_get_cores_none_of_the_others_have():
    """A search's trials running at once (local_share): each slot's workers on cores of their own."""
    assert shared_core_slices({0, 1}, 1, 1, share=2, slot=0) == [{0}]
    assert shared_core_slices({0, 1}, 1, 1, share=2, slot=1) == [{1}]
    assert shared_core_slices(range(8), 2, 2, share=2, slot=1) == [{4, 5}, {6, 7}]
    assert shared_core_slices({0, 1}, 1, 1, share=3, slot=2) is None  # more workers than cores
    assert shared_core_slices({0, 1}, 1, 2) == [{0, 1}]  # a lone run: as core_slices


def test_validation_batches_are_in_order_every_epoch_and_cheap_to_restart():
    """Keras restarts the validation iterator every epoch: a pipeline without map functions makes
    that a millisecond instead of tens (their instantiation), with the same batches."""
    import tensorflow as tf

    from nbdist.worker.datasets import validation_batches

    n, b = 70, 16
    x = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    y = np.arange(n)
    ds = validation_batches(x, y, b)
    for _ in range(2):  # a fresh iterator per epoch, as evaluate() makes
        (epoch,) = epochs_of(ds, n, b, 1)
        assert [len(by) for _, by in epoch] == batch_sizes(n, b)
        np.testing.assert_array_equal(np.concatenate([by for _, by in epoch]), y)
        np.testing.assert_array_equal(np.concatenate([bx for bx, _ in epoch]), x)
    graph = tf.compat.v1.GraphDef.FromString(ds._as_serialized_graph().numpy())
    assert not graph.library.function, [f.signature.name for f in graph.library.function]


def test_no_worker_pipeline_autotunes(tmp_path):
    """An autotuned iterator's model thread sleeps up to a minute between optimisations and deleting
    the iterator waits for it: a worker's fit then returned tens of seconds after its last epoch."""
    from nbdist.wire.shardfile import ShardReader, ShardWriter
    from nbdist.worker.datasets import validation_batches
    from nbdist.worker.streams import ShardStream, streamed_batches

    x, y = np.zeros((10, 3), np.float32), np.arange(10)
    writer = ShardWriter(str(tmp_path), labels=True)
    writer.append(x, y)
    writer.close()
    stream = ShardStream(ShardReader(str(tmp_path)), 4, False, 0, 0, 1 << 20)
    for ds in (repeated_batches(x, y, 4, True), validation_batches(x, y, 4), streamed_batches(stream)):
        assert ds.options().autotune.enabled is False
