"""An unchanged Keras cell's own model.fit under %%dist_train (issue 17): real TF, real workers.

Kept lean: each run trains digits for a few epochs on 2 workers.
"""
from __future__ import annotations

import csv

import keras
import numpy as np
import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist.driver.fit_call import bind_fit, fit_data, reconcile
from nbdist.errors import NbdistError

from ..conftest import mlp, relative_error
from ..models_and_fit import SEEN_AND_MODEL

pytestmark = pytest.mark.usefixtures("no_leftover_workers")


@pytest.mark.parametrize("strategy, weighting", [("averaging", "sample_weight"), ("allreduce", "class_weight")])
def test_weighted_fit_equals_the_local_call(digits, strategy, weighting):
    """C2 (averaging K=1, SGD) and C3 (allreduce): the same fit arguments give the local call's
    parameters to 1e-5, with sample_weight / class_weight; validation_split takes the same last rows
    (the merged val_loss equals local fit's)."""
    x, y = digits[0][:600], digits[1][:600]
    kwargs = {"validation_split": 0.2}
    if weighting == "sample_weight":
        kwargs["sample_weight"] = np.random.default_rng(0).uniform(0.2, 3.0, len(x)).astype("float32")
    else:
        kwargs["class_weight"] = {c: 1.0 + c for c in range(10)}
    local = mlp(seed=2, optimizer=keras.optimizers.SGD(0.1))
    remote = mlp(seed=2, optimizer=keras.optimizers.SGD(0.1))
    remote.set_weights(local.get_weights())
    expected = local.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0, **kwargs).history
    job = nbdist.train(remote, x, y, epochs=2, batch_size=16, workers=2, averaging_frequency=1, shuffle=False,
                       strategy=strategy, **kwargs)
    err = relative_error(remote.get_weights(), local.get_weights())
    assert err < 1e-5, err
    for key in ("loss", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(job.fit_history.history[key], expected[key], rtol=1e-5, err_msg=key)


def binary_digits(digits):
    x, y = digits
    yb = (y < 5).astype("float32")
    train, val = slice(0, 1000), slice(1000, 1400)
    order = np.argsort(yb[val], kind="stable")  # sorted by label: each worker validates on one class
    return x[train], yb[train], x[val][order], yb[val][order]


def test_per_epoch_metrics_are_merged_exactly(digits):
    """History's val_auc/precision/recall equal model.evaluate on the same rows and final weights to 1e-6:
    with validation rows sorted by label an average over workers gives nonsense (AUC ~0.5)."""
    x, y, xv, yv = binary_digits(digits)
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile("adam", "binary_crossentropy",
                  metrics=[keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision"),
                           keras.metrics.Recall(name="recall")])
    job = nbdist.train(model, x, y, validation_data=(xv, yv, np.ones(len(yv), "float32")), epochs=2,
                       batch_size=32, workers=2, strategy="allreduce")
    assert job.fit_history is not None
    expected = model.evaluate(xv, yv, verbose=0, return_dict=True)
    for key in ("auc", "precision", "recall", "loss"):
        got = job.history[f"val_{key}"][-1]
        assert abs(got - expected[key]) < 1e-6, (key, got, expected[key])
    assert expected["auc"] > 0.8  # learned: an average over the sorted shards would be near 0.5


CALLBACK_CELL = SEEN_AND_MODEL + """
history = model.fit(X, y, batch_size=64, epochs=25, validation_data=(Xv, yv), verbose=0, callbacks=[
    keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
    keras.callbacks.ReduceLROnPlateau(monitor="val_loss", patience=1, factor=0.5),
    keras.callbacks.ModelCheckpoint(CKPT, monitor="val_loss", save_best_only=True),
    keras.callbacks.CSVLogger(CSV), keras.callbacks.TensorBoard(TB), seen])
"""


def test_callbacks_run_in_the_notebook_and_decide_for_every_worker(ip, tmp_path):
    """The cell's own fit with EarlyStopping(restore_best_weights), ReduceLROnPlateau, ModelCheckpoint,
    CSVLogger and a custom callback: every worker stops at the epoch the merged history dictates and
    changes its learning rate at the same epoch; the model holds the best epoch's weights; one loadable
    .keras file and one CSV row per epoch on this machine."""
    ip.user_ns.update(CKPT=str(tmp_path / "best.keras"), CSV=str(tmp_path / "log.csv"), TB=str(tmp_path / "tb"))
    ip.run_cell_magic("dist_train", "--workers 2 --ui none", CALLBACK_CELL)
    ns = ip.user_ns
    history, job = ns["history"], ns["history_job"]
    assert isinstance(history, keras.callbacks.History)
    val_loss = history.history["val_loss"]
    epochs = len(val_loss)
    assert epochs < 25, "EarlyStopping never fired; the test needs it to"
    best = int(np.argmin(val_loss))
    assert epochs - 1 - best == 2  # patience 2, acted on the merged val_loss
    for rank, report in job.reports.items():
        assert report["last_epoch"] == epochs - 1, rank
        assert report["learning_rates"] == pytest.approx(history.history["learning_rate"], rel=1e-6), rank
    assert len(set(history.history["learning_rate"])) > 1, "ReduceLROnPlateau never fired"
    assert relative_error(ns["model"].get_weights(), ns["seen"].weights[best]) == 0.0
    saved = keras.saving.load_model(tmp_path / "best.keras")
    assert relative_error(saved.get_weights(), ns["seen"].weights[best]) == 0.0
    assert list(tmp_path.glob("*.keras")) == [tmp_path / "best.keras"]
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == list(range(epochs))
    # TensorBoard: one run directory here, with the merged per-epoch scalars
    for run, prefix in (("train", ""), ("validation", "val_")):
        events = list((tmp_path / "tb" / run).glob("events.out.tfevents.*"))
        assert len(events) == 1, (run, events)
        for name in ("loss", "accuracy"):
            assert tensorboard_scalars(tmp_path / "tb" / run, f"epoch_{name}") == pytest.approx(
                history.history[prefix + name], rel=1e-6), (run, name)
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == ["train", "validation"]


def tensorboard_scalars(run_dir, tag: str) -> list[float]:
    """The values of one scalar tag, by step, from a run directory's event file."""
    import tensorflow as tf
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [float(tf.make_ndarray(e.tensor_proto)) for e in sorted(acc.Tensors(tag), key=lambda e: e.step)]


MULTI_CELL = """
import keras
keras.utils.set_random_seed(4)
pixels = keras.Input((64,), name="pixels")
tokens = keras.Input((8,), name="tokens", dtype="int32")
t = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(17, 8)(tokens))
h = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([pixels, t]))
digit = keras.layers.Dense(10, activation="softmax", name="digit")(h)
parity = keras.layers.Dense(1, activation="sigmoid", name="parity")(h)
model = keras.Model({"pixels": pixels, "tokens": tokens}, {"digit": digit, "parity": parity})
model.compile("adam", loss={"digit": "sparse_categorical_crossentropy", "parity": "binary_crossentropy"},
              loss_weights={"digit": 1.0, "parity": 0.5}, metrics={"digit": ["accuracy"]})
hist = model.fit({"pixels": Xm, "tokens": Tm}, {"digit": ym, "parity": (ym % 2).astype("float32")},
                 batch_size=64, epochs=EPOCHS, verbose=0, shuffle=False,
                 callbacks=[keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.01 if epoch < 2 else 0.005)])
"""


def test_multi_input_multi_output_cell_and_learning_rate_schedule(ip, digits_split):
    """Dict inputs (one an integer sequence into an Embedding), dict outputs with a loss dict and
    loss_weights: digit accuracy within a point of the same cell run locally; LearningRateScheduler
    changes every worker's rate at the same epoch. Unshuffled, so the two runs see the same batches:
    shuffled, 4 epochs of two different orders differ by up to two points on 450 test digits."""
    x_train, x_test, y_train, y_test = digits_split
    tokens = lambda x: (x[:, ::8] * 16).astype("int32")  # a column of each image as "words"
    ip.user_ns.update(Xm=x_train, Tm=tokens(x_train), ym=y_train, EPOCHS=4)
    ip.run_cell_magic("dist_train", "--workers 2 --ui none --strategy allreduce", MULTI_CELL)
    ns = ip.user_ns
    test_inputs = {"pixels": x_test, "tokens": tokens(x_test)}
    test_targets = {"digit": y_test, "parity": (y_test % 2).astype("float32")}
    remote = ns["model"].evaluate(test_inputs, test_targets, verbose=0, return_dict=True)
    for report in ns["history_job"].reports.values():
        assert report["learning_rates"] == pytest.approx([0.01, 0.01, 0.005, 0.005])
    ip.run_cell(MULTI_CELL)  # the same cell, locally
    local = ns["model"].evaluate(test_inputs, test_targets, verbose=0, return_dict=True)
    acc = next(k for k in remote if k.endswith("accuracy"))
    assert abs(remote[acc] - local[acc]) <= 0.01 + 1e-9, (remote, local)


LIST_CELL = """
import keras
keras.utils.set_random_seed(4)
pixels = keras.Input((64,))
tokens = keras.Input((8,), dtype="int32")
t = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(17, 8)(tokens))
h = keras.layers.Dense(32, activation="relu")(keras.layers.Concatenate()([pixels, t]))
model = keras.Model([pixels, tokens], keras.layers.Dense(10, activation="softmax")(h))
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
hist = model.fit([Xm, Tm], ym, batch_size=64, epochs=EPOCHS, verbose=0, shuffle=False,
                 validation_data=([Xm[:100], Tm[:100]], ym[:100]))
"""


def test_list_inputs_cell_matches_local(ip, digits_split):
    """model.fit([x_a, x_b], y), the second input an integer sequence into an Embedding: the list
    travels in its order (swapped, the int tokens would meet the Dense and the floats the Embedding),
    and test accuracy is within a point of the same cell run locally."""
    x_train, x_test, y_train, y_test = digits_split
    tokens = lambda x: (x[:, ::8] * 16).astype("int32")
    ip.user_ns.update(Xm=x_train, Tm=tokens(x_train), ym=y_train, EPOCHS=4)
    ip.run_cell_magic("dist_train", "--workers 2 --ui none --strategy allreduce", LIST_CELL)
    ns = ip.user_ns
    assert len(ns["hist"].history["val_accuracy"]) == 4
    remote = ns["model"].evaluate([x_test, tokens(x_test)], y_test, verbose=0, return_dict=True)["accuracy"]
    ip.run_cell(LIST_CELL)  # the same cell, locally
    local = ns["model"].evaluate([x_test, tokens(x_test)], y_test, verbose=0, return_dict=True)["accuracy"]
    assert remote > 0.8 and abs(remote - local) <= 0.01 + 1e-9, (remote, local)


# -- refusals: one sentence, before any worker starts --------------------------------
def _bound(**kwargs):
    model = mlp()
    return bind_fit(model, (), kwargs, __import__("inspect").signature(keras.Model.fit))


def test_magic_options_and_fit_arguments_must_agree():
    fit = _bound(x=np.zeros((4, 64)), y=np.zeros(4), epochs=10)
    with pytest.raises(NbdistError, match="--epochs 5 on the magic line but model.fit\\(epochs=10\\)"):
        reconcile(fit, {"epochs": 5})
    assert reconcile(fit, {"epochs": 10})["epochs"] == 10
    assert reconcile(_bound(x=np.zeros((4, 64))), {"epochs": 3})["epochs"] == 3
    with pytest.raises(NbdistError, match="--batch-size 16 \\(per worker\\)"):
        reconcile(_bound(x=np.zeros((4, 64)), batch_size=32), {"batch_size": 16})
    with pytest.raises(NbdistError, match="drop --data"):
        reconcile(fit, {"data": "X,y"})
    assert reconcile(fit, {})["global_batch"] == 32  # Keras' default, split over the workers


@pytest.mark.parametrize("make, words", [
    (lambda: __import__("tensorflow").data.Dataset.from_tensor_slices((np.zeros((8, 64)), np.zeros(8))),
     "is a tf.data.Dataset"),
    (lambda: (row for row in np.zeros((8, 64))), "is a generator or iterator"),
])
def test_streams_get_a_sentence_not_dtype_object(make, words):
    with pytest.raises(NbdistError) as info:
        fit_data(_bound(x=make()))
    assert words in str(info.value) and "pass the arrays" in str(info.value)
    assert "dtype object" not in str(info.value)


def test_conflict_in_the_cell_is_a_usage_error_and_starts_nothing(ip):
    cell = ("model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation='softmax')])\n"
            "model.compile('sgd', 'sparse_categorical_crossentropy')\n"
            "model.fit(X, y, epochs=10)\n")
    ip.user_ns["keras"] = keras
    with pytest.raises(UsageError, match="--epochs 5 on the magic line"):
        ip.run_cell_magic("dist_train", "--workers 2 --epochs 5 --ui none", cell)
