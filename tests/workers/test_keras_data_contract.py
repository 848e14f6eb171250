"""Issue 46 (items 4 and 8): data Keras takes trains with Keras' meaning, and a finished run holds none of it.

An optional input given as None (``keras.Input(optional=True)``, ``x={"x": x, "o": None}``) trains as the
local fit does; after the run, done or failed, the job left in the notebook no longer holds the arrays.
"""
from __future__ import annotations

import gc
import weakref

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

import nbdist


class AddOptional(keras.layers.Layer):
    def call(self, a, b=None):
        return a if b is None else a + keras.ops.sum(b)


def optional_input_model() -> keras.Model:
    keras.utils.set_random_seed(5)
    x, o = keras.Input((64,), name="x"), keras.Input((3,), name="o", optional=True)
    out = keras.layers.Dense(10, activation="softmax")(AddOptional()(x, o))
    model = keras.Model({"x": x, "o": o}, out)
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    return model


def test_optional_none_input_trains_as_locally_and_the_run_keeps_no_data() -> None:
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32")[:512], y[:512].astype("float32")
    local = optional_input_model()
    expected = local.fit({"x": x, "o": None}, y, epochs=2, batch_size=64, shuffle=False, verbose=0).history["loss"]

    model = optional_input_model()
    job = nbdist.train(model, {"x": x, "o": None}, y, epochs=2, batch_size=32, workers=2, backend="local",
                       shuffle=False, strategy="allreduce", validation_split=0.125)
    assert job.history["loss"][0] == pytest.approx(expected[0], rel=0.05)  # 1/8 of the rows held out
    assert np.isfinite(job.history["val_loss"]).all()

    failing = optional_input_model()

    class Fails(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            raise RuntimeError("stop here")

    x2, y2 = x.copy(), y.copy()
    failed = nbdist.train(failing, {"x": x2, "o": None}, y2, epochs=1, batch_size=32, workers=2, backend="local",
                          callbacks=[Fails()], background=True)
    with pytest.raises(Exception, match="stop here") as caught:
        failed.wait()
    del caught  # its frames are wait()'s: the job's own references are what is left
    refs = [weakref.ref(a) for a in (x, y, x2, y2)]
    del x, y, x2, y2
    gc.collect()
    assert [r() is None for r in refs] == [True] * 4, "a finished run still holds the arrays it trained on"
    assert job.history["loss"] and failed.status == "failed"  # the jobs and their results stay


def test_a_generator_of_batches_with_an_optional_none_input_trains_as_locally() -> None:
    """``model.fit(gen)`` whose batches hold ``{"x": x, "o": None}``: the generator is read into arrays with the
    optional input None throughout (it failed: None batches could not be joined); the local fit's losses."""
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32")[:256], y[:256].astype("float32")

    def batches():
        for start in range(0, 256, 64):
            yield {"x": x[start:start + 64], "o": None}, y[start:start + 64]

    expected = optional_input_model().fit(batches(), verbose=0).history["loss"]
    job = nbdist.train(optional_input_model(), batches(), workers=2, backend="local", strategy="allreduce",
                       lr_scaling="none")
    np.testing.assert_allclose(job.history["loss"], expected, rtol=1e-5)
