"""R5: a catalogue of bad inputs through the real magics in IPython and through the API.

Every case must end in one sentence (no newline, under 300 characters) that names the
problem, with the kernel alive (the next cell runs) and the user's model weights and
data exactly as they were. Most cases are caught before any worker starts; the few that
need workers (a loss that diverges, empty validation shards) run real ones.
"""
from __future__ import annotations

import numpy as np
import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist.errors import NbdistError

from ..conftest import ipython_shell, wait_no_workers

# The cell most cases run: it hands the prepared, compiled model `m0` to the magic.
USE_M0 = "model = m0"


def build(width: int = 64, loss: str = "sparse_categorical_crossentropy", outputs: int = 10,
          compiled: bool = True, lr: float = 0.001):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(outputs, activation="softmax")])
    if compiled:
        model.compile(keras.optimizers.Adam(lr), loss, metrics=["accuracy"])
    return model


@pytest.fixture(scope="module")
def ip(digits):
    shell = ipython_shell()
    x, y = digits
    x, y = x[:200].copy(), y[:200].copy()
    nan_x = x.copy()
    nan_x[3, 5] = np.nan
    inf_x = x.copy()
    inf_x[7, 1] = np.inf
    nan_y = y.astype("float32")
    nan_y[2] = np.nan
    shell.user_ns.update(
        X=x, y=y, X_short=x[:150], X_strings=x.astype(str), X_object=x.astype(object),
        X_nan=nan_x, X_inf=inf_x, y_nan=nan_y, X_empty=x[:0], y_empty=y[:0], X_one=x[:1], y_one=y[:1],
        X_narrow=x[:, :32], X_3d=x.reshape(200, 8, 8), X_ragged=[[1.0, 2.0], [3.0]], X_scalar=5.0,
        y_onehot=np.eye(10, dtype="float32")[y], y_big=(y + 20), y_frac=y + 0.5,
        m0=build(), m_uncompiled=build(compiled=False), m_narrow=build(width=32),
        m_cce=build(loss="categorical_crossentropy"), not_a_model=[1, 2, 3],
    )
    yield shell


def snapshot(ns: dict) -> dict:
    """Copies of every array and every model's weights in the notebook."""
    import keras

    out = {}
    for name, value in ns.items():
        if name.startswith("_"):
            continue
        if isinstance(value, np.ndarray):
            out[name] = value.copy()
        elif isinstance(value, keras.Model):
            out[name] = [w.copy() for w in value.get_weights()]
    return out


def assert_untouched(before: dict, ns: dict) -> None:
    import keras

    for name, value in before.items():
        now = ns[name]
        if isinstance(now, keras.Model):
            now = now.get_weights()
            assert all(np.array_equal(a, b) for a, b in zip(value, now)), f"{name}'s weights changed"
        else:
            assert np.array_equal(value, now, equal_nan=value.dtype.kind == "f"), f"{name} changed"


def keras_refusal(err: ValueError) -> str:
    """What Keras' loss raises for labels it cannot take (issue 46: raised as Keras raises it), shown by IPython
    as Keras' sentence and nbdist's note, no traceback: the note's text."""
    shown = err._render_traceback_()
    assert len(shown) == 2 and shown[0].startswith("ValueError: ") and "Traceback" not in "".join(shown), shown
    return one_sentence(ValueError(shown[1]))


def one_sentence(err: BaseException) -> str:
    message = str(err)
    assert "\n" not in message.strip() and 0 < len(message) < 300, repr(message)
    assert "Traceback" not in message
    return message


# (id, magic line, cell body, words the sentence must contain)
TRAIN_CASES = [
    # -- data
    ("mismatched-lengths", "--data X_short,y", USE_M0, ["150 rows", "200"]),
    ("strings", "--data X_strings,y", USE_M0, ["dtype", "astype"]),
    ("object-dtype", "--data X_object,y", USE_M0, ["Python objects", "astype"]),
    ("empty-arrays", "--data X_empty,y_empty", USE_M0, ["empty"]),
    ("ragged-list", "--data X_ragged,y", USE_M0, ["cannot be turned into an array"]),
    ("scalar-data", "--data X_scalar,y", USE_M0, ["single value"]),
    ("features-too-narrow", "--data X_narrow,y", USE_M0, ["(32,)", "(64,)"]),
    ("features-3d", "--data X_3d,y", USE_M0, ["(8, 8)", "(64,)"]),
    ("labels-out-of-range", "--data X,y_big", USE_M0, ["class ids from 0 to 9"]),
    ("labels-fractional", "--data X,y_frac", USE_M0, ["whole class ids"]),
    ("onehot-with-sparse-loss", "--data X,y_onehot", USE_M0, ["sparse_categorical_crossentropy"]),
    ("integer-labels-with-onehot-loss", "--data X,y --model m_cce", "pass", ["one-hot"]),
    ("validation-too-narrow", "--data X,y --validation-data X_narrow,y", USE_M0, ["validation", "(32,)"]),
    ("missing-variable", "--data X,nope", USE_M0, ["'nope'"]),
    ("malformed-data-option", "--data X;y", USE_M0, ["--data X,y"]),
    ("no-data-option", "--epochs 1", USE_M0, ["--data is required"]),
    # -- options
    ("zero-epochs", "--data X,y --epochs 0", USE_M0, ["epochs", "at least 1"]),
    ("negative-epochs", "--data X,y --epochs -3", USE_M0, ["epochs", "-3"]),
    ("zero-batch-size", "--data X,y --batch-size 0", USE_M0, ["batch_size", "at least 1"]),
    ("text-batch-size", "--data X,y --batch-size many", USE_M0, ["batch-size", "many"]),
    ("zero-workers", "--data X,y --workers 0", USE_M0, ["workers", "at least 1"]),
    ("unknown-strategy", "--data X,y --strategy gossip", USE_M0, ["gossip", "averaging"]),
    ("unknown-backend", "--data X,y --backend yarn", USE_M0, ["yarn", "local"]),
    ("unknown-ui", "--data X,y --ui fancy", USE_M0, ["fancy", "widgets"]),
    ("zero-averaging-frequency", "--data X,y --averaging-frequency 0", USE_M0, ["averaging_frequency"]),
    ("negative-seed", "--data X,y --seed -1", USE_M0, ["seed", "-1"]),
    ("bad-out-name", "--data X,y --out 1st", USE_M0, ["--out", "1st"]),
    ("engine-with-averaging", "--data X,y --strategy averaging --engine gloo", USE_M0, ["--strategy allreduce"]),
    ("unknown-option", "--data X,y --epoks 3", USE_M0, ["--epoks"]),
    # -- models
    ("not-compiled", "--data X,y", "model = m_uncompiled", ["not compiled", "compile("]),
    ("not-a-keras-model", "--data X,y --model not_a_model", "pass", ["list", "not a Keras model"]),
    ("no-model-assigned", "--data X,y", "z = 1", ["assigned no Keras model"]),
    ("two-models", "--data X,y", "a = m0\nb = m_narrow", ["2 Keras models", "--model NAME"]),
    ("model-name-missing", "--data X,y --model nomodel", "pass", ["'nomodel'"]),
    ("cell-raises", "--data X,y", "model = m0\n1 / 0", ["the cell raised an error"]),
]

# Paths: rel-ckpt adds --checkpoint-dir. Until then the option says it is not available;
# afterwards its own checks must answer these cases with a sentence that names the option.
CHECKPOINT_CASES = [
    ("checkpoint-dir-is-a-file", "--data X,y --checkpoint-dir {file}", USE_M0, ["--checkpoint-dir"]),
    ("checkpoint-dir-not-writable", "--data X,y --checkpoint-dir /proc/nbdist-ckpt", USE_M0, ["--checkpoint-dir"]),
]


def run_bad(ip, line: str, cell: str) -> str:
    ip.user_ns.pop("model", None)  # so that `model = m0` (re)binds a model, as a fresh cell would
    before = snapshot(ip.user_ns)
    result = ip.run_cell(f"%%dist_train --ui none --out bad_hist {line}\n{cell}")  # the case's options win
    err = result.error_in_exec or result.error_before_exec
    message = keras_refusal(err) if isinstance(err, ValueError) else one_sentence(err)
    assert isinstance(err, (UsageError, ValueError)), repr(err)
    assert_untouched(before, ip.user_ns)
    assert ip.run_cell("kernel_alive = 1 + 1").success and ip.user_ns["kernel_alive"] == 2
    return message


@pytest.mark.parametrize("line,cell,words", [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES])
def test_dist_train_bad_input(ip, line, cell, words):
    message = run_bad(ip, line, cell)
    for word in words:
        assert word in message, message
    assert not wait_no_workers(5)


@pytest.mark.parametrize("line,cell,words", [c[1:] for c in CHECKPOINT_CASES], ids=[c[0] for c in CHECKPOINT_CASES])
def test_checkpoint_dir_bad_paths(ip, tmp_path, line, cell, words):
    path = tmp_path / "a-file"
    path.write_text("not a directory")
    message = run_bad(ip, line.format(file=path), cell)
    for word in words:
        assert word in message, message


EVALUATE_CASES = [
    ("evaluate-not-compiled", "m_uncompiled --data X,y", ["not compiled"]),
    ("evaluate-no-labels", "m0 --data X", ["needs features and labels"]),
    ("evaluate-missing-model", "nomodel --data X,y", ["'nomodel'"]),
    ("evaluate-not-a-model", "not_a_model --data X,y", ["not a Keras model"]),
    ("evaluate-narrow", "m0 --data X_narrow,y", ["(32,)", "(64,)"]),
    ("evaluate-onehot-sparse", "m0 --data X,y_onehot", ["sparse_categorical_crossentropy"]),
    ("evaluate-zero-workers", "m0 --data X,y --workers 0", ["workers"]),
]


@pytest.mark.parametrize("line,words", [c[1:] for c in EVALUATE_CASES], ids=[c[0] for c in EVALUATE_CASES])
def test_dist_evaluate_bad_input(ip, line, words):
    before = snapshot(ip.user_ns)
    result = ip.run_cell(f"%dist_evaluate {line}")
    err = result.error_in_exec or result.error_before_exec
    assert isinstance(err, (UsageError, ValueError)), repr(err)
    message = keras_refusal(err) if isinstance(err, ValueError) else one_sentence(err)
    for word in words:
        assert word in message, message
    assert_untouched(before, ip.user_ns)
    assert ip.run_cell("kernel_alive = 2 + 2").success


API_CASES = [
    ("api-unknown-option", lambda m, x, y: nbdist.train(m, x, y, epoks=3), ["epoks"]),
    ("api-not-a-model", lambda m, x, y: nbdist.train("model", x, y, epochs=1), ["str", "not a Keras model"]),
    ("api-validation-not-a-pair", lambda m, x, y: nbdist.train(m, x, y, validation_data=(x,)),
     ["(x_val, y_val)"]),
    ("api-epochs-as-text", lambda m, x, y: nbdist.train(m, x, y, epochs="3"), ["epochs", "'3'"]),
    ("api-features-on-numpy", lambda m, x, y: nbdist.train(m, x, y, features="a"), ["Spark DataFrame"]),
]


@pytest.mark.parametrize("call,words", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_api_bad_input(ip, call, words):
    ns = ip.user_ns
    before = snapshot(ns)
    with pytest.raises(NbdistError) as info:
        call(ns["m0"], ns["X"], ns["y"])
    message = one_sentence(info.value)
    for word in words:
        assert word in message, message
    assert_untouched(before, ns)


# -- cases that need real workers -------------------------------------------------
def test_fewer_rows_than_workers_train_on_as_many_workers_as_rows(ip, caplog):
    """Not bad input (issue 46): one row on 2 workers trains on one worker, as the local fit, said in one line."""
    ns = ip.user_ns
    ns.pop("model", None)
    result = ip.run_cell("%%dist_train --data X_one,y_one --epochs 1 --workers 2 --ui none --out one_row\nmodel = m0")
    assert result.success, result.error_in_exec
    assert ns["one_row_job"].world_size == 1 and len(ns["one_row"]["loss"]) == 1
    assert any("1 worker instead of 2" in r.getMessage() for r in caplog.records), caplog.text
    assert not wait_no_workers(5)


def test_validation_rows_fewer_than_workers_still_train(ip):
    """An empty validation shard on one worker is legal: the run finishes and reports val metrics."""
    ns = ip.user_ns
    ns.pop("model", None)  # so that `model = m0` binds a model, as a fresh cell would
    result = ip.run_cell("%%dist_train --data X,y --validation-data X_one,y_one --epochs 1 --workers 2 "
                         "--ui none --out tiny_val\nmodel = m0")
    assert result.success, result.error_in_exec
    assert len(ns["tiny_val"]["val_loss"]) == 1 and np.isfinite(ns["tiny_val"]["val_loss"][0])
    assert not wait_no_workers(5)
