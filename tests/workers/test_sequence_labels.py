"""Issue 39: a sequence tagger as Keras trains it, a class id per time step with per-step sample weights,
trains under %%dist_train (it was refused with "one integer class per row") and matches the local fit."""
from __future__ import annotations

import keras
import numpy as np
import pytest

from ..conftest import relative_error

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

TAGGER = """
def tagger():
    model = keras.Sequential([keras.Input((20, 3)), keras.layers.GRU(8, return_sequences=True, seed=1),
                              keras.layers.TimeDistributed(keras.layers.Dense(2, activation="softmax"))])
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
"""
FIT = "history = model.fit(Xs, ys, sample_weight=ws, batch_size=32, epochs=2, shuffle=False, validation_split=0.25)\n"


def test_a_sequence_tagger_trains_as_locally(ip):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 20, 3)).astype("float32")
    y = (np.cumsum(x[..., 0], axis=1) > 0).astype("int64")  # one class id per time step: (n, 20)
    w = rng.uniform(0.5, 2.0, (256, 20)).astype("float32")  # and a weight per time step
    ip.user_ns.update(Xs=x, ys=y, ws=w, keras=keras)
    ip.run_cell(TAGGER + "local = tagger()\nstart = local.get_weights()\n")
    local = ip.user_ns["local"]
    expected = local.fit(x, y, sample_weight=w, batch_size=32, epochs=2, shuffle=False, validation_split=0.25,
                         verbose=0).history
    result = ip.run_cell("%%dist_train --workers 2 --ui none\nmodel = tagger()\nmodel.set_weights(start)\n" + FIT)
    assert result.success, result.error_in_exec
    got = ip.user_ns["history"].history
    assert set(expected) <= set(got)
    for key, values in expected.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5, atol=1e-7, err_msg=key)
    assert relative_error(ip.user_ns["model"].get_weights(), local.get_weights()) < 1e-5
