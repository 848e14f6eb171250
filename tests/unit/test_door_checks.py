"""Every check of a model against its data, at the entries' one door (checks.py): each refusal is one sentence
raised before a job exists, so no worker starts (the public functions, as a notebook calls them)."""
from __future__ import annotations

import keras
import numpy as np
import pytest

import nbdist
from nbdist.errors import NbdistError


class Batches(keras.utils.PyDataset):
    def __init__(self, width: int, labels: bool = True) -> None:
        super().__init__()
        self.width, self.labels = width, labels

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int):
        x = np.zeros((4, self.width), "float32")
        return (x, np.zeros(4, "int64")) if self.labels else (x,)


@pytest.fixture(scope="module")
def model():
    m = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3, activation="softmax")])
    m.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    m.fit(np.zeros((4, 5)), np.zeros(4), verbose=0)
    return m


def _refusal(call) -> str:
    with pytest.raises(NbdistError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message and message.endswith(".")
    return message


def test_inference_refusals_are_the_same_sentences(model):
    x, y = np.zeros((8, 5), "float32"), np.zeros(8, "int64")
    assert _refusal(lambda: nbdist.predict(model, np.zeros((8, 7)), workers=2)) == (
        "the features have shape (7,) per row but the model expects (5,); pass data shaped like the training data.")
    assert _refusal(lambda: nbdist.predict(model, Batches(7), workers=2)) == (
        "the PyDataset's batches have features of shape (7,) per row but the model expects (5,); return batches "
        "shaped like the training data.")
    assert "batches hold no labels" in _refusal(lambda: nbdist.evaluate(model, Batches(5, labels=False), workers=2))
    assert _refusal(lambda: nbdist.evaluate(model, x, y + 4, workers=2)) == (
        "the labels must be whole class ids from 0 to 2 for this 3-output model; check y or the model's last layer.")
    assert _refusal(lambda: nbdist.evaluate(model, x, y, features="a", workers=2)).startswith(
        "--features and --label name the columns of a Spark DataFrame")
    assert _refusal(lambda: nbdist.predict("model", x)) == "the model is a str, not a Keras model; pass a keras.Model."
    fresh = keras.Sequential([keras.layers.Reshape((4, 4))])  # unbuilt: built on one row, as Keras builds it
    assert _refusal(lambda: nbdist.predict(fresh, x)).startswith(
        "the model could not be built on one row of the prediction data (")


def test_training_refusals_name_the_training_data(model):
    x = np.zeros((8, 5), "float32")
    assert _refusal(lambda: nbdist.train(model, x, np.full(8, 4), workers=2)) == (
        "the training data labels must be whole class ids from 0 to 2 for this 3-output model; check y or the "
        "model's last layer.")
    assert "the validation data features have shape (7,)" in _refusal(
        lambda: nbdist.train(model, x, np.zeros(8), validation_data=(np.zeros((4, 7)), np.zeros(4)), workers=2))
    assert _refusal(lambda: nbdist.train(3, x, np.zeros(8))) == "model is a int, not a Keras model; pass a keras.Model."


def test_an_uncompiled_model_is_refused_at_the_door():
    """Checked once, at the entry: the job never receives an unchecked model (the spec no longer re-checks)."""
    plain = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    assert _refusal(lambda: nbdist.train(plain, np.zeros((8, 5)), np.zeros(8), workers=2)) == (
        "model is not compiled; call model.compile(optimizer, loss, metrics=[...]) in the cell.")
