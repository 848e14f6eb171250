"""C5: distributed evaluate/predict on real worker processes equals local Keras and scikit-learn.

Models are trained locally with a few quick epochs (evaluation needs no distributed
training); each distributed run uses 3 workers on 1000 rows, i.e. shards of 334/333/333.
"""
from __future__ import annotations

import re
import warnings

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits
from sklearn.metrics import (
    accuracy_score,
    confusion_matrix,
    f1_score,
    precision_recall_fscore_support,
    precision_score,
    recall_score,
    roc_auc_score,
)

import nbdist
from nbdist.errors import NbdistError

TOL = 1e-6


@pytest.fixture(scope="module")
def binary():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(1000, 8)).astype("float32")
    y = ((x[:, 0] + 0.5 * x[:, 1] + rng.normal(scale=0.8, size=1000)) > 0).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision"),
                           keras.metrics.Recall(name="recall")])
    model.fit(x, y, epochs=3, batch_size=32, verbose=0)
    return model, x, y


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    x = (x / 16).astype("float32")[:1000]
    y = y[:1000]
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, epochs=3, batch_size=32, verbose=0)
    return model, x, y


def test_binary_classifier_metrics_equal_local_keras_and_sklearn(binary) -> None:
    model, x, y = binary
    weights = [w.copy() for w in model.get_weights()]
    import pandas as pd

    result = nbdist.evaluate(model, pd.DataFrame(x), pd.Series(y), workers=3, backend="local", batch_size=64)
    local = model.evaluate(x, y, batch_size=64, verbose=0, return_dict=True)
    for name in ("loss", "accuracy", "auc", "precision", "recall"):
        assert result[name] == pytest.approx(local[name], abs=TOL), name
    scores = model.predict(x, verbose=0)[:, 0]
    pred = scores > 0.5
    avg = result["averages"]
    assert result["samples"] == 1000
    assert avg["accuracy"] == pytest.approx(accuracy_score(y, pred), abs=TOL)
    assert avg["precision"] == pytest.approx(precision_score(y, pred), abs=TOL)
    assert avg["recall"] == pytest.approx(recall_score(y, pred), abs=TOL)
    assert avg["f1"] == pytest.approx(f1_score(y, pred), abs=TOL)
    assert avg["roc_auc"] == pytest.approx(roc_auc_score(y, scores), abs=TOL)  # exact, not thresholded
    np.testing.assert_array_equal(result["confusion_matrix"], confusion_matrix(y, pred))
    assert 0.7 < avg["roc_auc"] < 1.0  # the model learned something, so the comparison means something
    for before, after in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(before, after)  # the user's model is untouched


def test_multiclass_metrics_equal_local_keras_and_sklearn(digits) -> None:
    model, x, y = digits
    result = nbdist.evaluate(model, x, y, workers=3, backend="local")
    local = model.evaluate(x, y, verbose=0, return_dict=True)
    assert result["loss"] == pytest.approx(local["loss"], abs=TOL)
    assert result["accuracy"] == pytest.approx(local["accuracy"], abs=TOL)
    pred = model.predict(x, verbose=0).argmax(axis=1)
    labels = list(range(10))
    np.testing.assert_array_equal(result["confusion_matrix"], confusion_matrix(y, pred, labels=labels))
    p, r, f, s = precision_recall_fscore_support(y, pred, labels=labels, zero_division=0)
    for c in labels:
        got = result["per_class"][c]
        assert (got["precision"], got["recall"], got["f1"], got["support"]) == pytest.approx(
            (p[c], r[c], f[c], s[c]), abs=TOL)
    assert result["averages"]["accuracy"] == pytest.approx(accuracy_score(y, pred), abs=TOL)
    assert result["averages"]["macro_f1"] == pytest.approx(f1_score(y, pred, average="macro"), abs=TOL)
    assert result["averages"]["weighted_f1"] == pytest.approx(f1_score(y, pred, average="weighted"), abs=TOL)


def test_regression_metrics_with_regulariser_equal_local_keras() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(500, 4)).astype("float32")
    y = (x @ np.array([1.0, 2.0, -1.0, 0.5]) + rng.normal(size=500) * 0.1).astype("float32")
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, kernel_regularizer="l2")])
    model.compile("adam", "mse", metrics=["mae", keras.metrics.R2Score(), keras.metrics.RootMeanSquaredError()])
    model.fit(x, y, epochs=2, verbose=0)
    result = nbdist.evaluate(model, x, y, workers=3, backend="local")
    local = model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(local) <= set(result) and "confusion_matrix" not in result
    for name, value in local.items():
        assert result[name] == pytest.approx(value, abs=TOL, rel=TOL), name


def test_bad_input_gets_one_sentence_before_any_worker_starts(digits) -> None:
    model, x, y = digits
    unbuilt = keras.Sequential([keras.layers.Dense(3)])  # built on the data as Keras would, once compiled
    with pytest.raises(NbdistError, match="is not compiled"):
        nbdist.evaluate(unbuilt, x, y, workers=2)
    uncompiled = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    with pytest.raises(NbdistError, match="is not compiled"):
        nbdist.evaluate(uncompiled, x, y, workers=2)
    with pytest.raises(ValueError) as info:  # what Keras raises, with nbdist's sentence as a note (issue 46)
        nbdist.evaluate(model, x, np.eye(10)[y], workers=2)
    assert re.search(r"labels \(shape \(\d+, 10\)\) do not fit sparse_categorical_crossentropy",
                     info.value.__notes__[0])
    with pytest.raises(NbdistError, match=r"features have shape \(63,\) per row"):
        nbdist.evaluate(model, x[:, :63], y, workers=2)
    with pytest.raises(NbdistError, match="class ids from 0 to 9"):
        nbdist.evaluate(model, x, y + 5, workers=2)
    with pytest.raises(NbdistError, match="not a Keras model"):
        nbdist.predict("model", x)
    with pytest.raises(NbdistError, match="unknown option"):
        nbdist.evaluate(model, x, y, epochs=3)
    fresh = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    fresh.compile("adam", "sparse_categorical_crossentropy")
    with warnings.catch_warnings(record=True) as caught, pytest.raises(NbdistError, match="features have shape"):
        warnings.simplefilter("always")
        nbdist.evaluate(fresh, x[:, :63], y, workers=2)  # warns, then fails the features' check
    assert any("never been trained" in str(w.message) for w in caught)


# -- magics, through a real IPython shell -------------------------------------------
@pytest.fixture(scope="module")
def shell():
    from ..conftest import ipython_shell

    return ipython_shell()


def test_dist_evaluate_magic_shows_tables_and_stores_result(shell, digits, capsys) -> None:
    from ..conftest import worker_processes

    model, x, y = digits
    shell.user_ns.update({"clf": model, "X_test": x, "y_test": y})
    shell.run_line_magic("dist_evaluate", "clf --data X_test,y_test --workers 2 --backend local --out ev")
    shown = capsys.readouterr().out
    result = shell.user_ns["ev"]
    local = model.evaluate(x, y, verbose=0, return_dict=True)
    assert result["accuracy"] == pytest.approx(local["accuracy"], abs=TOL)
    assert result["loss"] == pytest.approx(local["loss"], abs=TOL)
    assert "metric" in shown and f"{local['accuracy']:.4f}" in shown
    assert "per class" in shown and "confusion matrix (rows: true class" in shown
    assert "pred 9" in shown and str(int(result["confusion_matrix"][3, 3])) in shown
    # Every worker is gone (other children may be legitimate: pyspark keeps its JVM after an earlier
    # module's SparkContext stopped).
    assert not worker_processes()


def test_dist_predict_magic_equals_local_predict_row_for_row(shell, digits, capsys) -> None:
    model, x, _ = digits
    shell.user_ns.update({"clf": model, "X_new": x})
    shell.run_line_magic("dist_predict", "clf --data X_new --workers 3 --backend local --out y_prob")
    assert "y_prob: predictions of shape (1000, 10) in input order" in capsys.readouterr().out
    got, want = shell.user_ns["y_prob"], model.predict(x, verbose=0)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL)
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))


def test_magic_bad_input_is_a_usage_error_sentence(shell, digits) -> None:
    from IPython.core.error import UsageError

    model, x, y = digits
    shell.user_ns.update({"clf": model, "X_test": x, "y_test": y})
    with pytest.raises(UsageError, match="no variable named 'X_missing'"):
        shell.run_line_magic("dist_evaluate", "clf --data X_missing,y_test")
    with pytest.raises(UsageError, match="no variable named 'nomodel'"):
        shell.run_line_magic("dist_evaluate", "nomodel --data X_test,y_test")
    with pytest.raises(UsageError, match="needs features and labels"):
        shell.run_line_magic("dist_evaluate", "clf --data X_test")
    with pytest.raises(UsageError, match="names only the features"):
        shell.run_line_magic("dist_predict", "clf --data X_test,y_test")
    with pytest.raises(UsageError, match="is not a valid variable name"):
        shell.run_line_magic("dist_predict", "clf --data X_test --out 1x")
    assert "clf" in shell.user_ns and shell.user_ns["X_test"] is x  # nothing of the user's was touched


def test_report_renders_html_and_text() -> None:
    from nbdist.ui.report import EvaluationReport

    result = {"loss": 0.25, "accuracy": 0.9, "samples": 10, "kind": "multiclass",
              "confusion_matrix": np.array([[4, 1], [0, 5]]),
              "per_class": {0: {"precision": 1.0, "recall": 0.8, "f1": 0.8889, "support": 5},
                            1: {"precision": 0.8333, "recall": 1.0, "f1": 0.9091, "support": 5}},
              "averages": {"accuracy": 0.9, "macro_f1": 0.899}}
    page = EvaluationReport(result)._repr_html_()
    assert page.count("<table") == 3 and "<td>0.2500</td>" in page and "true 1" in page
    text = repr(EvaluationReport(result))
    assert "macro_f1" in text and "0.8889" in text and "kind" not in text


Pair = __import__("collections").namedtuple("Pair", "digit parity")


def test_inference_as_keras_unbuilt_model_tuple_outputs_leftover_losses_no_leaked_socket() -> None:
    """Issue 46: what Keras' evaluate/predict accept, nbdist accepts with the same answer: a model with
    no weights yet is built on the first rows; a namedtuple of outputs comes back as that namedtuple; a
    subclassed model with an activity regularizer evaluated locally first (graph tensors left in its
    layers' losses) is sent; and no socket is left for the collector (a ResourceWarning, an error under
    -W error)."""
    import gc

    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32")[:300], y[:300]
    keras.utils.set_random_seed(3)
    unbuilt = keras.Sequential([keras.layers.Dense(10, activation="softmax")])
    unbuilt.compile("sgd", "sparse_categorical_crossentropy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # never trained: said once, as it should be
        warnings.simplefilter("error", ResourceWarning)
        got = nbdist.evaluate(unbuilt, x, y, workers=2, backend="local")
        gc.collect()
    assert unbuilt.built and got["loss"] == pytest.approx(unbuilt.evaluate(x, y, verbose=0), rel=1e-5)

    inp = keras.Input((64,))
    pair = keras.Model(inp, Pair(keras.layers.Dense(10)(inp), keras.layers.Dense(2)(inp)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        out = nbdist.predict(pair, x, workers=2, backend="local")
        gc.collect()
    local = pair.predict(x, verbose=0)
    assert type(out) is Pair and type(local) is Pair
    np.testing.assert_allclose(out.digit, local.digit, atol=1e-5)
    np.testing.assert_allclose(out.parity, local.parity, atol=1e-5)

    class Regularised(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(10, activity_regularizer="l2")

        def call(self, a):
            return self.dense(a)

    model = Regularised()
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    expected = model.evaluate(x, y, verbose=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        got = nbdist.evaluate(model, x, y, workers=2, backend="local")
    assert got["loss"] == pytest.approx(expected, rel=1e-4)
