"""``%%dist_train`` in a real IPython shell: the happy path, help, and bad input."""
from __future__ import annotations

import numpy as np
import pytest
from IPython.core.error import UsageError

from ..conftest import worker_processes

MODEL_CELL = """
import keras
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""


def run(ip, line: str, cell: str = MODEL_CELL):
    return ip.run_cell(f"%%dist_train {line}\n{cell}")


def usage_error(result) -> str:
    err = result.error_in_exec or result.error_before_exec
    assert isinstance(err, UsageError), repr(err)
    message = str(err)
    assert "\n" not in message.strip() and len(message) < 300, message
    return message


def test_trains_and_writes_back_model_and_history(ip, no_leftover_workers):
    result = run(ip, "--data X,y --validation-data Xv,yv --epochs 3 --batch-size 32 --workers 2 --ui none "
                     "--out hist --seed 1")
    assert result.success, result.error_in_exec
    hist = ip.user_ns["hist"]
    assert len(hist["loss"]) == 3 and len(hist["val_accuracy"]) == 3
    model = ip.user_ns["model"]
    pred = model.predict(ip.user_ns["Xv"], verbose=0)
    assert pred.shape == (200, 10)
    assert hist["val_accuracy"][-1] == pytest.approx(float((pred.argmax(1) == ip.user_ns["yv"]).mean()), abs=1e-6)


def test_text_ui_prints_one_line_per_epoch(ip, capsys):
    result = run(ip, "--data X,y --epochs 2 --workers 2 --ui text")
    assert result.success
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("Epoch")]
    assert [ln.split(" - ")[0] for ln in lines] == ["Epoch 1/2", "Epoch 2/2"]


def test_help_lists_the_options(ip):
    doc = ip.find_cell_magic("dist_train").__doc__
    for option in ("--data", "--epochs", "--batch-size", "--workers", "--strategy", "--averaging-frequency",
                   "--model", "--out", "--seed", "--ui", "--backend", "--validation-data"):
        assert option in doc


@pytest.fixture
def trained_model(ip):
    """A model already in the notebook whose weights must survive every bad call untouched."""
    ip.run_cell(MODEL_CELL.replace("model =", "keep ="))
    keep = ip.user_ns["keep"]
    before = [w.copy() for w in keep.get_weights()]
    yield keep
    assert all(np.array_equal(a, b) for a, b in zip(before, keep.get_weights()))


@pytest.mark.parametrize("line, cell, fragment", [
    ("--data nope,y --workers 2", MODEL_CELL, "no variable named 'nope'"),
    ("--data X,yv --workers 2", MODEL_CELL, "x has 600 rows but y has 200 rows"),
    ("--data X,y --workers 2", "z = 1", "assigned no Keras model"),
    ("--data X,y --workers 2", MODEL_CELL + "\nother = keras.models.clone_model(model)", "--model NAME"),
    ("--data X,y --workers 2", MODEL_CELL.split("model.compile")[0], "not compiled"),
    ("--data X,y --workers 0", MODEL_CELL, "workers must be"),
    ("--data X,y --frobnicate 3", MODEL_CELL, "unrecognized arguments"),
    ("--data X,y --strategy magic", MODEL_CELL, "unknown strategy"),
    ("--data X,y --model missing", MODEL_CELL, "no variable named 'missing'"),
    ("--data X,y --out 3x", MODEL_CELL, "not a valid variable name"),
    ("--data X y", MODEL_CELL, "unrecognized arguments"),
])
def test_bad_input_gets_one_sentence_and_touches_nothing(ip, trained_model, line, cell, fragment):
    result = run(ip, line + " --ui none", cell)
    assert fragment in usage_error(result)
    assert not worker_processes()
    assert ip.run_cell("1 + 1").result == 2  # the shell is alive
