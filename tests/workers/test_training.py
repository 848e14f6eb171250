"""Real training on real worker processes: equivalence to local fit, and accuracy."""
from __future__ import annotations

import keras
import numpy as np
import pytest

import nbdist
from nbdist.data.sharding import deal_rows

from ..conftest import mlp, relative_error

pytestmark = pytest.mark.usefixtures("no_leftover_workers")


def test_one_worker_equals_local_fit(digits):
    """C1: one worker, same seed and data order: parameters equal to 1e-6 relative."""
    x, y = digits
    local = mlp(seed=1)
    remote = mlp(seed=1)
    remote.set_weights(local.get_weights())
    local.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    job = nbdist.train(remote, x, y, epochs=2, batch_size=32, strategy="averaging", workers=1, shuffle=False, seed=1)
    assert job.status == "done"
    assert relative_error(remote.get_weights(), local.get_weights()) < 1e-6
    # The optimizer state came back too: both models continue identically.
    assert relative_error([v.numpy() for v in remote.optimizer.variables[2:]],
                          [v.numpy() for v in local.optimizer.variables[2:]]) < 1e-6
    assert int(remote.optimizer.iterations.numpy()) == int(local.optimizer.iterations.numpy()) > 0


def interleave_batches(x: np.ndarray, workers: int, batch: int) -> np.ndarray:
    """The order in which one big-batch local fit sees the examples the workers see together: the
    rows as they are, since every global batch of ``workers * batch`` rows is dealt over the workers
    in order (data.deal_rows; ``nbdist.train(model, x, y)`` is ``model.fit(x, y)``)."""
    rows = np.concatenate(deal_rows(len(x), workers * batch, workers))
    return x[np.sort(rows)]


def test_averaging_every_step_with_sgd_equals_local_fit_with_the_combined_batch(digits):
    """C2: K=1, plain SGD, 2 workers with batch b == local fit with batch 2b, to 1e-5 relative."""
    x, y = digits
    b = 16
    local = mlp(seed=2, optimizer=keras.optimizers.SGD(0.1))
    remote = mlp(seed=2, optimizer=keras.optimizers.SGD(0.1))
    remote.set_weights(local.get_weights())
    idx = interleave_batches(np.arange(len(x)), 2, b)
    local.fit(x[idx], y[idx], batch_size=2 * b, epochs=1, shuffle=False, verbose=0)
    nbdist.train(remote, x, y, epochs=1, batch_size=b, workers=2,
                 strategy="averaging", averaging_frequency=1, shuffle=False)
    err = relative_error(remote.get_weights(), local.get_weights())
    assert err < 1e-5, err


def rounds_of_local_sgd(model, x, y, workers: int, batch: int, k: int) -> None:
    """Parameter averaging by hand: each shard trains ``k`` batches from the average, then the row-weighted average.

    A shard whose batches ran out contributes no rows to the later rounds (nbdist's empty rounds).
    """
    shards = [(x[rows], y[rows]) for rows in deal_rows(len(x), workers * batch, workers)]
    start = model.get_weights()
    rounds = max(-(-len(sx) // (k * batch)) for sx, _ in shards)
    for r in range(rounds):
        total, acc = 0, [np.zeros_like(w, dtype=np.float64) for w in start]
        for sx, sy in shards:
            part = slice(r * k * batch, (r + 1) * k * batch)
            rows = len(sx[part])
            if not rows:
                continue
            model.set_weights(start)
            model.fit(sx[part], sy[part], batch_size=batch, epochs=1, shuffle=False, verbose=0)
            acc = [a + rows * w.astype(np.float64) for a, w in zip(acc, model.get_weights())]
            total += rows
        start = [(a / total).astype(np.float32) for a in acc]
    model.set_weights(start)


def test_averaging_every_k_steps_equals_k_local_steps_then_the_average(digits):
    """C2 for K > 1, where a worker runs its K steps in one call into TensorFlow (worker/blocks.py): 2 workers,
    SGD, K=4, equal to rounds of 4 local batches per shard then the row-weighted average, to 1e-5."""
    x, y = digits
    local = mlp(seed=4, optimizer=keras.optimizers.SGD(0.1))
    remote = mlp(seed=4, optimizer=keras.optimizers.SGD(0.1))
    remote.set_weights(local.get_weights())
    rounds_of_local_sgd(local, x, y, workers=2, batch=16, k=4)
    job = nbdist.train(remote, x, y, epochs=1, batch_size=16, workers=2,
                       strategy="averaging", averaging_frequency=4, shuffle=False)
    assert job.reports[0]["rounds"] == 15  # 57 batches per worker: after batch 4, 8, ..., 56 and the 57th
    err = relative_error(remote.get_weights(), local.get_weights())
    assert err < 1e-5, err


def test_averaging_is_not_once_at_the_end(digits):
    """A control for C2: with K=1000 (one round per epoch) the result must differ from big-batch SGD."""
    x, y = digits
    local = mlp(seed=2, optimizer=keras.optimizers.SGD(0.1))
    remote = mlp(seed=2, optimizer=keras.optimizers.SGD(0.1))
    remote.set_weights(local.get_weights())
    idx = interleave_batches(np.arange(len(x)), 2, 16)
    local.fit(x[idx], y[idx], batch_size=32, epochs=1, shuffle=False, verbose=0)
    nbdist.train(remote, x, y, epochs=1, batch_size=16, workers=2,
                 strategy="averaging", averaging_frequency=1000, shuffle=False)
    assert relative_error(remote.get_weights(), local.get_weights()) > 1e-3


def test_accuracy_two_workers_within_one_point_of_local(digits_split):
    x_train, x_test, y_train, y_test = digits_split
    local = mlp(seed=3)
    dist = mlp(seed=3)
    dist.set_weights(local.get_weights())
    local.fit(x_train, y_train, batch_size=32, epochs=20, verbose=0)
    job = nbdist.train(dist, x_train, y_train, epochs=20, batch_size=32, strategy="averaging", workers=2, seed=3,
                       validation_data=(x_test, y_test))
    acc = lambda m: float((m.predict(x_test, verbose=0).argmax(1) == y_test).mean())
    local_acc, dist_acc = acc(local), acc(dist)
    assert dist_acc >= local_acc - 0.01, (dist_acc, local_acc)
    h = job.history
    assert set(h) >= {"loss", "accuracy", "val_loss", "val_accuracy"}
    assert all(len(v) == 20 for v in h.values())
    assert h["loss"][-1] < h["loss"][0]
    # The last validation is measured on the returned weights, over every validation row once: each epoch
    # reads whole passes of one kept iterator (worker/validation.py).
    assert h["val_accuracy"][-1] == pytest.approx(dist_acc, abs=1e-6)
    loss = dist.evaluate(x_test, y_test, verbose=0, return_dict=True)["loss"]
    assert h["val_loss"][-1] == pytest.approx(loss, rel=1e-5)
