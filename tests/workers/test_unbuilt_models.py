"""Models as notebooks often write them: no input shape (built by fit on the data, as Keras' own fit
builds them), and a text input fed a 1-D array of strings (Keras adds the trailing axis of size 1)."""
from __future__ import annotations

import keras
import numpy as np
import pytest

import nbdist


def _deferred(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_a_model_without_an_input_shape_is_built_on_the_data_as_fit_builds_it(ip, digits):
    """One worker equals the local fit of the same unbuilt model: built on the data before launch (with the
    weights the local fit's build draws), trained, and its weights back in the notebook's model."""
    x, y = digits
    x, y = x[:256], y[:256]
    local = _deferred(7)
    local.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    ip.user_ns.update(xs=x, ys=y, make=_deferred)
    ip.run_cell_magic("dist_train", "--workers 1 --backend local --ui none", """
unbuilt = make(7)
fitted = unbuilt.fit(xs, ys, batch_size=32, epochs=2, shuffle=False, verbose=0)
""")
    model = ip.user_ns["unbuilt"]
    assert model.built and len(model.weights) == len(local.weights)
    for got, want in zip(model.get_weights(), local.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(ip.user_ns["fitted"].history["loss"]) == 2


def test_a_subclassed_model_never_called_trains_on_two_workers_and_evaluates(digits):
    class Net(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden, self.out = keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)

        def call(self, x, training=False):
            return self.out(self.hidden(x))

    x, y = digits
    model = Net()
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    job = nbdist.train(model, x, y, epochs=4, batch_size=32, workers=2, backend="local", ui="none")
    assert job.status == "done" and job.history["loss"][-1] < job.history["loss"][0]
    merged = nbdist.evaluate(model, x, y, workers=2, backend="local")
    assert merged["accuracy"] == pytest.approx(model.evaluate(x, y, verbose=0, return_dict=True)["accuracy"], abs=1e-6)
    assert merged["accuracy"] > 0.8


def test_a_text_model_takes_a_flat_array_of_strings_and_evaluates_on_the_workers(digits):
    """keras.Input((1,), dtype="string") fed an array of shape (n,): Keras adds the axis; so must the checks.
    Evaluating it on the workers predicts through tf.data (Keras' array path refuses a numpy str dtype)."""
    x, y = digits
    texts = np.array([" ".join(f"t{int(v)}" for v in row[18:30:3] * 16) for row in x[:600]])
    labels = y[:600]
    vectorize = keras.layers.TextVectorization(max_tokens=40, output_sequence_length=4)
    vectorize.adapt(texts)
    inputs = keras.Input((1,), dtype="string")
    hidden = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(40, 8)(vectorize(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    job = nbdist.train(model, texts, labels, epochs=3, batch_size=32, workers=2, backend="local", ui="none")
    assert job.status == "done"
    merged = nbdist.evaluate(model, texts, labels, workers=2, backend="local")
    import tensorflow as tf

    here = model.evaluate(tf.data.Dataset.from_tensor_slices((texts, labels)).batch(64), verbose=0, return_dict=True)
    assert merged["accuracy"] == pytest.approx(here["accuracy"], abs=1e-6)
    assert merged["loss"] == pytest.approx(here["loss"], rel=1e-4)
