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
    for run_dir in ("train", "validation"):  # TensorBoard: the same epoch scalars
        for tag in ("epoch_loss", "epoch_accuracy"):
            np.testing.assert_allclose(tensorboard_scalars(tmp_path / "remote" / "tb" / run_dir, tag),
                                       tensorboard_scalars(tmp_path / "local" / "tb" / run_dir, tag), rtol=1e-5)
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


def backed_up_run(ip, out, magic: bool) -> dict:
    """The run interrupted at the end of epoch 2 (its backup kept), then the same cell rerun without the
    interruption: it restores the backup and trains epochs 3 to 5."""
    ip.user_ns["STOP_AT"] = 1
    with pytest.raises(Exception):  # noqa: B017 - the interruption, whichever way the cell reports it
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
