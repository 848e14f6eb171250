"""The documented contract of Keras' built-in callbacks under ``%%dist_train`` (issue 30): the same cell run
locally and on 2 workers (allreduce, unshuffled, so both take the same steps) leaves the same History, the
same model and the same files, to 1e-5. One model (digits) and few epochs; several callbacks share a run.

Covered elsewhere and not repeated here: TerminateOnNaN on a diverging fit (test_same_step.py), a
custom callback reading the workers' weights each epoch (test_fit_call.py), and the .keras checkpoint of
``--checkpoint-dir`` (test_checkpoint.py)."""
from __future__ import annotations

import csv

import keras
import numpy as np
import pytest

from nbdist.errors import raised_on_worker

from .test_fit_call import tensorboard_scalars

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

MODEL = """
import keras
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.05), "sparse_categorical_crossentropy", metrics=["accuracy"])
"""
# EarlyStopping stops after 6 of 10 epochs and restores epoch 5's weights; ReduceLROnPlateau halves the
# rate at epoch 4 on top of LearningRateScheduler's decay (both in the History's learning_rate).
EVERY_CALLBACK = MODEL + """
hist = model.fit(X[:320], y[:320], batch_size=64, epochs=10, shuffle=False, verbose=0,
                 validation_data=(Xv[:160], yv[:160]), callbacks=[
    keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05, restore_best_weights=True),
    keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=0.3),
    keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.9),
    keras.callbacks.ModelCheckpoint(OUT + "/best.keras", monitor="val_loss", save_best_only=True),
    keras.callbacks.CSVLogger(OUT + "/log.csv"), keras.callbacks.TensorBoard(OUT + "/tb"),
    keras.callbacks.TerminateOnNaN()])
"""


def run(ip, cell: str, out, magic: bool) -> dict:
    out.mkdir(exist_ok=True)
    ip.user_ns["OUT"] = str(out)
    if magic:
        ip.run_cell_magic("dist_train", "--workers 2 --ui none --strategy allreduce", cell)
    else:
        ip.run_cell(cell).raise_error()
    return {"history": ip.user_ns["hist"].history, "weights": ip.user_ns["model"].get_weights()}


def assert_close(got, expected, what: str) -> None:
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=what)


def assert_same_history(got: dict, expected: dict) -> None:
    assert set(got) == set(expected), (sorted(got), sorted(expected))
    for key, values in expected.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)


def test_built_in_callbacks_leave_what_local_fit_leaves(ip, tmp_path):
    local = run(ip, EVERY_CALLBACK, tmp_path / "local", magic=False)
    remote = run(ip, EVERY_CALLBACK, tmp_path / "remote", magic=True)
    history = local["history"]
    assert len(history["loss"]) < 10, "EarlyStopping never fired; the test needs it to"
    rates = history["learning_rate"]
    assert any(b < 0.8 * a for a, b in zip(rates, rates[1:])), "ReduceLROnPlateau never fired"
    assert_same_history(remote["history"], history)  # History: every entry, the rates included
    assert_close(remote["weights"], local["weights"], "restored best weights")  # EarlyStopping
    # The restored weights are the 5th epoch's (the last that improved val_loss by min_delta), not the 6th's.
    restored = ip.user_ns["model"].evaluate(ip.user_ns["Xv"][:160], ip.user_ns["yv"][:160], verbose=0)[0]
    assert restored == pytest.approx(history["val_loss"][-2], rel=1e-5) != history["val_loss"][-1]
    assert_close(keras.saving.load_model(tmp_path / "remote" / "best.keras").get_weights(),
                 keras.saving.load_model(tmp_path / "local" / "best.keras").get_weights(), "ModelCheckpoint")
    rows = {}
    for side in ("local", "remote"):
        with open(tmp_path / side / "log.csv") as f:
            rows[side] = list(csv.DictReader(f))
    assert list(rows["remote"][0]) == list(rows["local"][0])  # CSVLogger: the same columns
    for got, expected in zip(rows["remote"], rows["local"], strict=True):
        np.testing.assert_allclose([float(v) for v in got.values()], [float(v) for v in expected.values()],
                                   rtol=1e-5)
    # TensorBoard: the same epoch scalars, and the evaluation curve written at on_test_end (issue 46)
    for run_dir, tag in [("train", "epoch_loss"), ("train", "epoch_accuracy"), ("validation", "epoch_loss"),
                         ("validation", "epoch_accuracy"), ("validation", "evaluation_loss_vs_iterations")]:
        local_curve = tensorboard_scalars(tmp_path / "local" / "tb" / run_dir, tag)
        assert local_curve, tag
        np.testing.assert_allclose(tensorboard_scalars(tmp_path / "remote" / "tb" / run_dir, tag), local_curve,
                                   rtol=1e-5)
    assert sorted(p.name for p in (tmp_path / "remote" / "tb").iterdir()) == ["train", "validation"]


BACKED_UP = MODEL + """
class Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == STOP_AT:
            raise RuntimeError("interrupted")
cbs = [keras.callbacks.BackupAndRestore(OUT + "/backup")] + ([Interrupt()] if STOP_AT is not None else [])
hist = model.fit(X[:320], y[:320], batch_size=64, epochs=5, shuffle=False, verbose=0,
                 validation_data=(Xv[:160], yv[:160]), callbacks=cbs)
"""


# Monitors on a compiled metric in mode "auto": Keras tells from the built model's metrics that accuracy is to be
# maximised (the notebook's model never took a step). The validation accuracy stops rising at epoch 7 of 8.
METRIC_MONITORS = MODEL + """
hist = model.fit(X[:320], y[:320], batch_size=64, epochs=8, shuffle=False, verbose=0,
                 validation_data=(Xv[:160], yv[:160]), callbacks=[
    keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=0, restore_best_weights=True),
    keras.callbacks.ReduceLROnPlateau(monitor="accuracy", factor=0.5, patience=0, min_delta=0.05),
    keras.callbacks.ModelCheckpoint(OUT + "/best.keras", monitor="val_accuracy", save_best_only=True)])
"""


def test_monitors_of_a_metric_maximise_it_as_locally(ip, tmp_path):
    local = run(ip, METRIC_MONITORS, tmp_path / "local", magic=False)
    remote = run(ip, METRIC_MONITORS, tmp_path / "remote", magic=True)
    history = local["history"]
    accuracy = history["val_accuracy"]
    assert len(accuracy) < 8 and accuracy.index(max(accuracy)) < len(accuracy) - 1, "EarlyStopping never fired"
    rates = history["learning_rate"]
    assert any(b < 0.8 * a for a, b in zip(rates, rates[1:])), "ReduceLROnPlateau on accuracy never fired"
    assert_same_history(remote["history"], history)
    assert_close(remote["weights"], local["weights"], "the weights of the best val_accuracy")
    assert_close(keras.saving.load_model(tmp_path / "remote" / "best.keras").get_weights(),
                 keras.saving.load_model(tmp_path / "local" / "best.keras").get_weights(), "ModelCheckpoint")
    # A metric the model does not have: Keras' own ValueError, at the first epoch's end, as locally.
    cell = METRIC_MONITORS.replace('monitor="val_accuracy", patience=0', 'monitor="val_auc", patience=0')
    ip.user_ns["OUT"] = str(tmp_path / "remote")
    local_error = ip.run_cell(cell).error_in_exec
    remote_error = ip.run_cell("%%dist_train --workers 2 --ui none\n" + cell).error_in_exec
    assert type(local_error) is type(remote_error) is ValueError, (local_error, remote_error)
    assert str(remote_error) == str(local_error) and "monitor=val_auc" in str(local_error)


def backed_up_run(ip, out, magic: bool) -> dict:
    """The run interrupted at the end of epoch 2 (its backup kept), then the same cell rerun without the
    interruption: it restores the backup and trains epochs 3 to 5. The callback's RuntimeError comes out of
    the fit as itself (issue 46), as Keras' BackupAndRestore test expects."""
    ip.user_ns["STOP_AT"] = 1
    with pytest.raises(RuntimeError, match="^interrupted$"):
        run(ip, BACKED_UP, out, magic)
    assert (out / "backup").is_dir()
    ip.user_ns["STOP_AT"] = None
    rerun = run(ip, BACKED_UP, out, magic)
    assert not (out / "backup").exists()  # removed at the end of a completed fit
    return rerun


def test_backup_and_restore_resumes_an_interrupted_run_as_locally(ip, tmp_path):
    local = backed_up_run(ip, tmp_path / "local", magic=False)
    remote = backed_up_run(ip, tmp_path / "remote", magic=True)
    assert len(local["history"]["loss"]) == 3  # epochs 3 to 5: the rerun started from the backup
    assert_same_history(remote["history"], local["history"])
    assert_close(remote["weights"], local["weights"], "weights after the rerun")


# Issue 46: every epoch-level hook in Keras' order, validation's included (validation_freq=2: epochs 2 and 4),
# with self.model holding the moving averages where SwapEMAWeights swaps them in; array-valued metrics
# (F1Score per class) and ReduceLROnPlateau's learning_rate in the History. (TensorBoard's evaluation curve:
# test_built_in_callbacks_leave_what_local_fit_leaves; Keras' TensorBoard cannot log an array metric.)
HOOKS = """
import keras, numpy as np
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.05, use_ema=True, ema_overwrite_frequency=None), "categorical_crossentropy",
              metrics=["accuracy", keras.metrics.F1Score()])
calls = []

class Hooks(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        calls.append(("train_begin",))
    def on_epoch_begin(self, epoch, logs=None):
        calls.append(("epoch_begin", epoch))
    def on_test_begin(self, logs=None):
        calls.append(("test_begin", self.model.get_weights()))
    def on_test_end(self, logs=None):
        calls.append(("test_end", dict(logs)))
    def on_epoch_end(self, epoch, logs=None):
        calls.append(("epoch_end", epoch, sorted(logs)))
    def on_train_end(self, logs=None):
        calls.append(("train_end", sorted(logs)))

one_hot = np.eye(10, dtype="float32")
hist = model.fit(X[:320], one_hot[y[:320]], batch_size=64, epochs=4, shuffle=False, verbose=0, validation_freq=2,
                 validation_data=(Xv[:160], one_hot[yv[:160]]), callbacks=[
    keras.callbacks.SwapEMAWeights(), Hooks(),
    keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0),
    keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)])
"""


def test_every_epoch_hook_runs_in_keras_order_with_what_keras_gives_it(ip, tmp_path, caplog):
    local = run(ip, HOOKS, tmp_path / "local", magic=False)
    local_calls = ip.user_ns["calls"]
    with caplog.at_level("WARNING", logger="nbdist.driver.callbacks"):
        remote = run(ip, HOOKS, tmp_path / "remote", magic=True)
    remote_calls = ip.user_ns["calls"]
    names = [c[0] for c in remote_calls]
    assert names == [c[0] for c in local_calls]
    assert names.count("test_begin") == 2 and names.index("test_end") == names.index("epoch_end", 3) - 1
    for got, expected in zip(remote_calls, local_calls):
        if got[0] == "test_begin":  # the moving averages swapped in, as SwapEMAWeights does locally
            assert_close(got[1], expected[1], "the model's weights at on_test_begin")
        elif got[0] == "test_end":  # Keras' evaluate's logs: un-prefixed names
            assert list(got[1]) == list(expected[1]) and "loss" in got[1]
            np.testing.assert_allclose(np.hstack(list(got[1].values())), np.hstack(list(expected[1].values())),
                                       rtol=1e-5)
        else:
            assert got == expected
    assert_same_history(remote["history"], local["history"])  # f1_score arrays, learning_rate
    assert remote["history"]["val_f1_score"][0].shape == (10,) and "learning_rate" in remote["history"]
    warned = [r.getMessage() for r in caplog.records if "batch-level hooks are not called" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("LambdaCallback defines on_train_batch_end")


# Issue 46: what Keras raises, the cell's fit raises (type and message); NaN as Keras treats it; nbdist's own
# control flow passes a cell's `except Exception:` (keras-tuner's _try_run_and_update_trial catches exactly so).
NAN_LABELS = """
import keras, numpy as np
keras.utils.set_random_seed(2)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.SGD(0.1), "categorical_crossentropy")
labels = np.eye(10, dtype="float32")[y[:256]]
labels[100] = np.nan  # global batch 1
caught = None
try:
    hist = model.fit(X[:256], labels, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=CBS)
except RuntimeError as exc:
    caught = exc
"""
RAISING_LOSS = """
import keras
def picky(y_true, y_pred):
    raise ValueError("picky refuses these labels\\nReceived: something")
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
model.compile("sgd", picky)
model.fit(X[:128], y[:128], batch_size=64, epochs=1, verbose=0)
"""
SWALLOWED = """
import keras
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
swallowed = []
try:
    model.fit(X[:256], y[:256], batch_size=64, epochs=1, verbose=0, validation_data=(Xv[:64], yv[:64]),
              callbacks=CBS)
except Exception as exc:  # keras-tuner's own catch around each trial's fit
    swallowed.append(exc)
"""


def test_what_keras_raises_the_fit_raises_and_nan_is_keras_to_act_on(ip, tmp_path):
    from IPython.core.error import UsageError

    ns = ip.user_ns
    magic = "%%dist_train --workers 2 --ui none --strategy allreduce\n"
    # NaN labels train, as locally: the loss is NaN from batch 1 on, every epoch in the History.
    for prefix in ("", magic):
        ns["CBS"] = []
        assert ip.run_cell(prefix + NAN_LABELS).success
        assert len(ns["hist"].history["loss"]) == 2 and np.isnan(ns["hist"].history["loss"]).all()
    # TerminateOnNaN(raise_error=True): Keras' RuntimeError, raised at the batch, with Keras' words.
    ns["CBS"] = [keras.callbacks.TerminateOnNaN(raise_error=True)]
    ip.run_cell(NAN_LABELS).raise_error()
    local = ns["caught"]
    ip.run_cell(magic + NAN_LABELS).raise_error()
    assert type(ns["caught"]).__mro__[0].__name__ == "RuntimeError" and str(ns["caught"]) == str(local)
    assert "at batch 1." in str(local) and "Traceback" in ns["caught"].worker_traceback
    # A ValueError raised in the workers' step is a ValueError in the notebook, with its own whole message
    # (not TensorFlow's "in user code:" wrapper), the worker's traceback kept and shown once.
    result = ip.run_cell(magic + RAISING_LOSS)
    err = result.error_in_exec
    assert type(err) is ValueError and raised_on_worker(err), repr(err)
    assert str(err) == "picky refuses these labels\nReceived: something"
    assert err.rank in (0, 1) and "picky" in err.worker_traceback and err._render_traceback_() == []
    # SwapEMAWeights without use_ema: Keras' ValueError (at the first validation locally), before any worker starts.
    ns["CBS"] = [keras.callbacks.SwapEMAWeights()]
    local = ip.run_cell(SWALLOWED.replace("except Exception", "except KeyError")).error_in_exec
    remote = ip.run_cell(magic + SWALLOWED.replace("except Exception", "except KeyError")).error_in_exec
    assert type(local) is type(remote) is ValueError and str(remote) == str(local) and "use_ema" in str(local)
    # nbdist's refusal is not swallowed by the cell's `except Exception:` (the magic says it in one sentence).
    ns["CBS"] = [keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"), save_freq=3)]
    ns.pop("swallowed", None)
    with pytest.raises(UsageError, match="save_freq=3"):
        ip.run_cell_magic("dist_train", "--workers 2 --ui none", SWALLOWED)
    assert ns["swallowed"] == []
    # Nor is the trial cell's hand-over under %%dist_tune: the trial trains on the cell's fit.
    ns["CBS"] = []
    ip.run_cell_magic("dist_tune", "--trials 1 --parallel 1 --objective val_accuracy --models-dir none --ui none "
                      f"--storage sqlite:///{tmp_path}/tune.db", SWALLOWED)
    assert ns["swallowed"] == [] and [t.state.name for t in ns["study"].trials] == ["COMPLETE"]
