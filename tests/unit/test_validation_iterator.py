"""Validation reads one iterator for the whole fit (worker/validation.py), with the same logs as Keras' own."""
from __future__ import annotations

import keras
import numpy as np

from nbdist.worker.datasets import validation_batches
from nbdist.worker.validation import KeepValidationIterator, reads_whole_passes

from ..conftest import mlp


class Iterators(keras.callbacks.Callback):
    """The iterator each epoch's validation read."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[object] = []  # held, so no two can share an id

    def on_test_batch_end(self, batch, logs=None):
        if batch == 0:
            self.seen.append(self.model._eval_epoch_iterator._current_iterator)


def fit(x, y, xv, yv, keep: bool) -> tuple[dict, list[object]]:
    model = mlp(seed=5)
    val = validation_batches(xv, yv, 32)
    assert reads_whole_passes(val)
    seen = Iterators()
    callbacks = [seen] + ([KeepValidationIterator()] if keep else [])
    steps = -(-len(xv) // 32)
    hist = model.fit(x, y, batch_size=32, epochs=4, validation_data=val, validation_steps=steps, verbose=0,
                     shuffle=False, callbacks=callbacks)
    return hist.history, seen.seen


def test_one_iterator_serves_every_epoch_with_the_same_logs(digits):
    x, y = digits
    x, y, xv, yv = x[:600], y[:600], x[600:825], y[600:825]  # 225 rows: a short last batch
    kept, kept_ids = fit(x, y, xv, yv, keep=True)
    own, own_ids = fit(x, y, xv, yv, keep=False)
    assert len(kept_ids) == 4 and all(it is kept_ids[0] for it in kept_ids)
    assert len({id(it) for it in own_ids}) == 4  # Keras' own makes a new one every epoch
    for key in ("val_loss", "val_accuracy"):
        np.testing.assert_allclose(kept[key], own[key], rtol=1e-6)
