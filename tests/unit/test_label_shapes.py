"""Issue 39: the labels a loss takes are Keras' to say. For each loss and label shape (a class id per row, per
time step, per pixel, one-hot, broadcast regression targets, several outputs), nbdist refuses before launch
exactly where a local ``fit`` on the same rows fails, and then (issue 46) raising what that local fit raises,
its type and words, with nbdist's sentence as a note."""
from __future__ import annotations

import re

import keras
import numpy as np
import pytest

from nbdist.checks import check_labels_fit_loss
from nbdist.errors import NbdistError
from nbdist.model.labels import ROWS

N = ROWS  # the local fit sees as many rows as nbdist's check, so Keras' words name the same shapes


def one_output(out: tuple[int, ...], loss) -> keras.Model:
    inputs = keras.Input((4,))
    flat = keras.layers.Dense(int(np.prod(out)), activation="softmax" if out[-1] > 1 else "sigmoid")(inputs)
    model = keras.Model(inputs, keras.layers.Reshape(out)(flat))
    model.compile("sgd", loss, run_eagerly=True)
    return model


def two_outputs(loss, as_dict: bool) -> keras.Model:
    inputs = keras.Input((4,))
    cls = keras.layers.Dense(3, activation="softmax", name="cls")(inputs)
    reg = keras.layers.Dense(1, name="reg")(inputs)
    model = keras.Model(inputs, {"cls": cls, "reg": reg} if as_dict else [cls, reg])
    model.compile("sgd", loss, run_eagerly=True)
    return model


def labels(shape: tuple[int, ...], classes: int = 2) -> np.ndarray:
    return np.random.default_rng(0).integers(0, classes, (N, *shape)).astype("float32")


def local_error(model: keras.Model, y, sample_weight=None) -> str | None:
    """What the local fit says on these rows: None when it trains."""
    try:
        model.fit(np.ones((N, 4), "float32"), y, sample_weight=sample_weight, batch_size=N, epochs=1, verbose=0)
    except Exception as exc:  # Keras' refusal, whatever its type
        text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", str(exc))  # TensorFlow's placement, not Keras' words
        return " ".join(ln.strip() for ln in text.strip().splitlines() if ln.strip())
    return None


def assert_same_verdict(model: keras.Model, y, sample_weight=None) -> None:
    weights = [w.copy() for w in model.get_weights()]
    try:
        check_labels_fit_loss(model, y, sample_weight)
        ours = None
    except Exception as exc:  # what Keras raises
        ours = str(exc)
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))  # the check trains nothing
    theirs = local_error(model, y, sample_weight)
    if theirs is None:
        assert ours is None, ours
    else:
        assert ours is not None, f"local Keras refuses: {theirs}"
        assert theirs.split(" Received")[0][:60] in ours and "\n" not in ours, (ours, theirs)


@pytest.mark.parametrize("loss, out, y_shape, w_shape", [
    # a class id per row, per time step (a sequence tagger), per pixel (segmentation)
    ("sparse_categorical_crossentropy", (10,), (), None),
    ("sparse_categorical_crossentropy", (10,), (1,), None),
    ("sparse_categorical_crossentropy", (10,), (10,), None),
    ("sparse_categorical_crossentropy", (20, 2), (20,), (20,)),
    ("sparse_categorical_crossentropy", (20, 2), (20, 1), None),
    ("sparse_categorical_crossentropy", (20, 2), (), None),
    ("sparse_categorical_crossentropy", (5, 5, 3), (5, 5), None),
    ("sparse_categorical_crossentropy", (5, 5, 3), (5, 5, 1), (5, 5)),
    ("sparse_categorical_crossentropy", (5, 5, 3), (5, 3), None),
    (keras.losses.SparseCategoricalCrossentropy(ignore_class=0), (20, 2), (20,), None),
    # one-hot rows and the binary losses: the output's own shape
    ("categorical_crossentropy", (10,), (10,), None),
    ("categorical_crossentropy", (10,), (), None),
    ("categorical_crossentropy", (20, 2), (20, 2), None),
    (keras.losses.CategoricalFocalCrossentropy(), (10,), (9,), None),
    ("binary_crossentropy", (1,), (), None),
    ("binary_crossentropy", (1,), (1,), None),
    ("binary_crossentropy", (3,), (3,), None),
    ("binary_crossentropy", (3,), (1,), None),
    # regression losses broadcast as Keras' ops do
    ("mse", (1,), (), None),
    ("mse", (3,), (1,), None),
    ("mse", (3,), (2,), None),
    ("mae", (20, 1), (20,), (20,)),
    ("huber", (4,), (4,), None),
    ("kl_divergence", (3,), (3,), None),
    ("cosine_similarity", (3,), (4,), None),
])
def test_one_output_refused_exactly_where_local_keras_refuses(loss, out, y_shape, w_shape):
    model = one_output(out, loss)
    y = labels(y_shape, classes=out[-1] if out[-1] > 1 else 2)
    assert_same_verdict(model, y, None if w_shape is None else np.ones((N, *w_shape), "float32"))


@pytest.mark.parametrize("as_dict", [True, False])
def test_several_outputs_each_label_judged_by_its_own_loss(as_dict):
    losses = {"cls": "sparse_categorical_crossentropy", "reg": "mse"} if as_dict \
        else ["sparse_categorical_crossentropy", "mse"]
    model = two_outputs(losses, as_dict)
    good = {"cls": labels((), 3), "reg": labels((1,))}
    bad = {"cls": labels((3,), 3), "reg": labels((1,))}
    for y in (good, bad):
        assert_same_verdict(model, y if as_dict else [y["cls"], y["reg"]])


def test_a_sequence_taggers_labels_pass_and_a_wrong_shape_names_keras_reason():
    """The issue's tagger: GRU(return_sequences=True) + TimeDistributed(Dense(2, softmax)), a class id per
    time step and per-step sample weights; refused before, with a sentence about one class per row."""
    model = keras.Sequential([keras.Input((20, 3)), keras.layers.GRU(4, return_sequences=True),
                              keras.layers.TimeDistributed(keras.layers.Dense(2, activation="softmax"))])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    check_labels_fit_loss(model, labels((20,)), np.ones((N, 20), "float32"))
    with pytest.raises(ValueError, match=r"^Argument `output` must have rank") as info:
        check_labels_fit_loss(model, labels(()), None)
    assert "labels (shape (2,)) do not fit sparse_categorical_crossentropy" in info.value.__notes__[0]
    assert not isinstance(info.value, NbdistError)


def test_a_notebook_loss_is_not_run_here():
    """The notebook's own loss function is the user's code: it runs on the workers, never in this check."""
    calls = []

    def my_loss(y_true, y_pred):
        calls.append(1)
        return keras.ops.mean(keras.ops.square(y_pred))

    check_labels_fit_loss(one_output((10,), my_loss), labels((7,)), None)
    assert not calls
