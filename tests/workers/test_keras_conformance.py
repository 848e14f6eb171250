"""Keras' contract for a cell's ``fit``, ``evaluate`` and ``predict``, checked side by side (issue 46).

Each cell runs locally and as the cell of ``%%dist_train --workers 2 --strategy allreduce`` (unshuffled,
so both take the same steps), and what a user can observe must agree: every hook of
``keras.callbacks.Callback`` Keras calls at epoch granularity (train, epoch, and the test hooks around each
validation), in Keras' order with Keras' arguments and ``self.model`` holding the same weights; batch hooks
not called, with a warning for every callback that has one (class or instance); every built-in callback's
History entries, weights and files; every argument of ``fit``; the exception Keras raises (type and
message); NaN as Keras treats it; ``nbdist.evaluate``/``nbdist.predict`` returning what Keras returns.
Runs are module-scoped and shared by the tests that read them: a small MLP on digits, 2-3 epochs.
"""
from __future__ import annotations

import collections
import csv
import gc
import re
import warnings

import keras
import numpy as np
import pytest

import nbdist

from ..conformance_helpers import (
    BATCH_HOOKS,
    EPOCH_HOOKS,
    TEST_HOOKS,
    assert_same_events,
    assert_same_history,
    assert_same_weights,
    same_exception,
    side_by_side,
    tensorboard_tags,
)
from .test_fit_call import tensorboard_scalars

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

MODEL = """
import keras
from tests.conformance_helpers import HookRecorder
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(OPTIMIZER() if "OPTIMIZER" in globals() and OPTIMIZER else keras.optimizers.Adam(0.01),
              "sparse_categorical_crossentropy", metrics=["accuracy"])
"""


@pytest.fixture(scope="module")
def runs(ip, tmp_path_factory):
    """Each named cell's (local, nbdist) pair, run once on first use."""
    done: dict[str, tuple] = {}
    root = tmp_path_factory.mktemp("conformance")

    def get(name: str):
        if name not in done:
            cell, names = CELLS[name]
            ip.user_ns.pop("OPTIMIZER", None)
            done[name] = side_by_side(ip, cell, root / name, **names)
        return done[name]

    yield get
    ip.user_ns.pop("OPTIMIZER", None)


# -- hooks -----------------------------------------------------------------------------------------
HOOKS = MODEL + """
rec = HookRecorder()
lambda_seen = []
lam = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: lambda_seen.append(("epoch", epoch)),
                                     on_train_batch_end=lambda batch, logs: lambda_seen.append(("batch", batch)))
class BatchCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.batches = 0
    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
counter = BatchCounter()
hist = model.fit(X[:256], y[:256], batch_size=64, epochs=3, shuffle=False, verbose=0,
                 validation_data=(Xv[:128], yv[:128]), callbacks=[rec, lam, counter])
"""


def test_train_and_epoch_hooks_in_keras_order_with_keras_arguments(runs):
    """on_train_begin/end and on_epoch_begin/end: same order, indices, logs, and the model's weights then."""
    local, remote = runs("hooks")
    assert len(local.hooks(EPOCH_HOOKS)) == 8
    assert_same_events(remote.hooks(EPOCH_HOOKS), local.hooks(EPOCH_HOOKS))


def test_test_hooks_wrap_each_validation(runs):
    """on_test_begin/end around every validation, in Keras' place among the epoch hooks, with its logs."""
    local, remote = runs("hooks")
    both = EPOCH_HOOKS + TEST_HOOKS
    assert len(local.hooks(TEST_HOOKS)) == 6
    assert_same_events(remote.hooks(both), local.hooks(both))


def test_history_and_weights_as_local(runs):
    local, remote = runs("hooks")
    assert_same_history(remote, local)
    assert_same_weights(remote, local)


def test_batch_hooks_of_a_callback_class_not_called_with_a_warning(runs):
    local, remote = runs("hooks")
    assert local.ns["counter"].batches == 12
    assert remote.ns["counter"].batches == 0
    assert not remote.hooks(BATCH_HOOKS)
    assert any("BatchCounter" in s and "on_train_batch_end" in s for s in remote.said), remote.said


def test_batch_hooks_of_a_lambda_callback_not_called_with_a_warning(runs):
    """LambdaCallback sets its hooks on the instance: it is warned as a class that defines them."""
    local, remote = runs("hooks")
    assert ("batch", 0) in local.ns["lambda_seen"]
    assert remote.ns["lambda_seen"] == [("epoch", e) for e in range(3)]
    assert any("LambdaCallback" in s and "on_train_batch_end" in s for s in remote.said), remote.said


# -- built-in callbacks ------------------------------------------------------------------------------
BUILT_INS = MODEL + """
hist = model.fit(X[:320], y[:320], batch_size=64, epochs=10, shuffle=False, verbose=0,
                 validation_data=(Xv[:160], yv[:160]), callbacks=[
    keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05, restore_best_weights=True),
    keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=0.5),
    keras.callbacks.ModelCheckpoint(OUT + "/ckpt/e{epoch:02d}.weights.h5", save_weights_only=True),
    keras.callbacks.CSVLogger(OUT + "/log.csv"), keras.callbacks.TensorBoard(OUT + "/tb")])
"""


def test_early_stopping_restores_the_best_weights_as_locally(runs):
    local, remote = runs("built_ins")
    assert len(local.history["loss"]) < 10, "EarlyStopping never fired; the test needs it to"
    assert remote.history is not None and len(remote.history["loss"]) == len(local.history["loss"])
    assert_same_weights(remote, local)


REDUCE_LR = MODEL + """
hist = model.fit(X[:256], y[:256], batch_size=64, epochs=3, shuffle=False, verbose=0, callbacks=[
    keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=10.0)])
"""


@pytest.mark.parametrize("run", ["reduce_lr", "built_ins"])
def test_reduce_lr_on_plateau_learning_rate_in_history(runs, run):
    """The learning_rate ReduceLROnPlateau writes into the logs is in History, alone or beside others."""
    local, remote = runs(run)
    rates = local.history["learning_rate"]
    assert min(rates) < max(rates), "ReduceLROnPlateau never fired"
    assert_same_history(remote, local)


def test_model_checkpoint_writes_each_epoch_as_locally(runs):
    local, remote = runs("built_ins")
    names = [f for f in local.files() if f.startswith("ckpt/")]
    assert len(names) == len(local.history["loss"])
    assert [f for f in remote.files() if f.startswith("ckpt/")] == names
    for name in names:
        a, b = keras.models.clone_model(local.ns["model"]), keras.models.clone_model(local.ns["model"])
        a.load_weights(local.out / name)
        b.load_weights(remote.out / name)
        for u, v in zip(b.get_weights(), a.get_weights(), strict=True):
            np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6, err_msg=name)


def test_csv_logger_rows_as_locally(runs):
    local, remote = runs("built_ins")
    rows = {}
    for side in (local, remote):
        with open(side.out / "log.csv") as f:
            rows[side is local] = list(csv.DictReader(f))
    assert list(rows[False][0]) == list(rows[True][0])
    for got, want in zip(rows[False], rows[True], strict=True):
        np.testing.assert_allclose([float(v) for v in got.values()], [float(v) for v in want.values()], rtol=1e-5)


def test_tensorboard_writes_the_local_tags_and_curves(runs):
    """The default TensorBoard(log_dir): epoch curves and the evaluation_*_vs_iterations curves."""
    local, remote = runs("built_ins")
    for run_dir in ("train", "validation"):
        want = tensorboard_tags(local.out / "tb" / run_dir)
        assert tensorboard_tags(remote.out / "tb" / run_dir) == want, run_dir
        for tag in sorted(t for t in want if t.startswith(("epoch_", "evaluation_"))):
            np.testing.assert_allclose(tensorboard_scalars(remote.out / "tb" / run_dir, tag),
                                       tensorboard_scalars(local.out / "tb" / run_dir, tag), rtol=1e-5,
                                       err_msg=f"{run_dir}/{tag}")
    assert "evaluation_loss_vs_iterations" in tensorboard_tags(local.out / "tb" / "validation")


BATCH_SUMMARIES = """
import keras
import tensorflow as tf
keras.utils.set_random_seed(1)

class Summarised(keras.layers.Layer):
    def call(self, x):
        tf.summary.scalar("inside_the_model", keras.ops.sum(x))
        return x

model = keras.Sequential([keras.Input((64,)), Summarised(), keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", jit_compile=False)
hist = model.fit(X[:256], y[:256], batch_size=64, epochs=2, shuffle=False, verbose=0,
                 validation_data=(Xv[:128], yv[:128]), callbacks=[
    keras.callbacks.TensorBoard(OUT + "/tb", update_freq=1, write_steps_per_second=True)])
"""


def test_tensorboard_batch_summaries_and_the_models_own_as_locally(runs):
    """update_freq=1: batch scalars and the model's own tf.summary calls, in train and validation, at every
    global step as locally (their values are worker 0's share of each batch); the epoch's part as before."""
    local, remote = runs("batch_summaries")
    named = lambda side, run_dir: {t.rsplit("/", 1)[-1]: t for t in tensorboard_tags(side.out / "tb" / run_dir)}
    for run_dir in ("train", "validation"):  # the model's own tags are scoped by its layers' numbered names
        want, got = named(local, run_dir), named(remote, run_dir)
        assert set(got) == set(want), run_dir
        for tag in sorted(set(want) - {"keras"}):
            assert (len(tensorboard_scalars(remote.out / "tb" / run_dir, got[tag]))
                    == len(tensorboard_scalars(local.out / "tb" / run_dir, want[tag]))), f"{run_dir}/{tag}"
    assert {"batch_loss", "inside_the_model", "batch_steps_per_second"} <= set(named(local, "train"))
    assert "inside_the_model" in named(local, "validation")
    np.testing.assert_allclose(tensorboard_scalars(remote.out / "tb" / "train", "epoch_loss"),
                               tensorboard_scalars(local.out / "tb" / "train", "epoch_loss"), rtol=1e-5)


LR_SCHEDULE = MODEL + """
rec = HookRecorder()
hist = model.fit(X[:256], y[:256], batch_size=64, epochs=3, shuffle=False, verbose=0, callbacks=[
    rec, keras.callbacks.LearningRateScheduler(lambda epoch, lr: lr * 0.5)])
"""


def test_learning_rate_scheduler_as_locally(runs):
    local, remote = runs("lr_schedule")
    assert local.history["learning_rate"][-1] < local.history["learning_rate"][0]
    assert_same_history(remote, local)
    assert_same_weights(remote, local)


EMA = MODEL + """
rec = HookRecorder()
hist = model.fit(X[:256], y[:256], batch_size=64, epochs=3, shuffle=False, verbose=0,
                 validation_data=(Xv[:128], yv[:128]),
                 callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True), rec])
"""


def test_swap_ema_weights_validates_on_the_ema_weights(runs):
    """SwapEMAWeights swaps the EMA weights in for each validation and (swap_on_epoch) the epoch's end."""
    local, remote = runs("ema")
    assert_same_history(remote, local)
    assert_same_weights(remote, local)
    assert_same_events(remote.hooks(EPOCH_HOOKS + TEST_HOOKS), local.hooks(EPOCH_HOOKS + TEST_HOOKS))


EMA_MISUSE = MODEL + """
try:
    hist = model.fit(X[:128], y[:128], batch_size=64, epochs=1, shuffle=False, verbose=0,
                     validation_data=(Xv[:64], yv[:64]), callbacks=[keras.callbacks.SwapEMAWeights()])
except Exception as exc:
    caught = exc
"""


def test_swap_ema_weights_misuse_raises_keras_error(runs):
    local, remote = runs("ema_misuse")
    same_exception(remote.caught, local.caught)


NAN = """
import keras, numpy as np
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
model.compile(keras.optimizers.SGD(0.01), "mse")
labels = y[:256].astype("float32")
labels[200] = np.nan
try:
    hist = model.fit(X[:256], labels, batch_size=64, epochs=3, shuffle=False, verbose=0,
                     callbacks=[keras.callbacks.TerminateOnNaN(raise_error=RAISE)])
except Exception as exc:
    caught = exc
"""


def test_terminate_on_nan_stops_a_run_with_nan_labels_as_locally(runs):
    """NaN labels are trained on (no refusal); TerminateOnNaN stops the run in its first epoch."""
    local, remote = runs("nan")
    assert local.caught is None and local.history is not None
    assert remote.caught is None, f"{type(remote.caught).__name__}: {remote.caught}"
    assert remote.history is not None and len(remote.history["loss"]) == len(local.history["loss"]) == 1
    assert np.isnan(remote.history["loss"][0]) and np.isnan(local.history["loss"][0])


def test_terminate_on_nan_raise_error_raises_as_keras(runs):
    local, remote = runs("nan_raise")
    same_exception(remote.caught, local.caught)


ARRAY_METRIC = """
import keras
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "categorical_crossentropy", metrics=[keras.metrics.F1Score()])
onehot = keras.utils.to_categorical(y[:256], 10)
hist = model.fit(X[:256], onehot, batch_size=64, epochs=2, shuffle=False, verbose=0,
                 validation_data=(Xv[:128], keras.utils.to_categorical(yv[:128], 10)))
"""


def test_array_valued_metrics_in_history(runs):
    """F1Score per class: f1_score and val_f1_score, one array per epoch, as locally."""
    local, remote = runs("array_metric")
    assert np.asarray(local.history["f1_score"]).shape == (2, 10)
    assert_same_history(remote, local)


EMA_WRAPPED = MODEL + """
hist = model.fit(X[:256], y[:256], batch_size=64, epochs=3, shuffle=False, verbose=0,
                 validation_data=(Xv[:128], yv[:128]), callbacks=[
    keras.callbacks.ModelCheckpoint(OUT + "/last.weights.h5", save_weights_only=True)])
"""


def test_ema_under_a_loss_scale_optimizer_ends_on_the_local_weights(runs):
    """LossScaleOptimizer(Adam(use_ema=True)) and a callback that reads the model: the EMA weights at the end."""
    local, remote = runs("ema_wrapped")
    assert_same_history(remote, local)
    assert_same_weights(remote, local)


EAGER_ONE_WEIGHT = """
import keras
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1, use_bias=False)])
model.compile(keras.optimizers.SGD(0.001), "mse", run_eagerly=True)
hist = model.fit(X[:128], y[:128].astype("float32"), batch_size=32, epochs=2, shuffle=False, verbose=0)
"""


def test_run_eagerly_with_one_trainable_weight(runs):
    local, remote = runs("eager_one_weight")
    assert len(local.ns["model"].trainable_weights) == 1
    assert remote.raised is None, f"{type(remote.raised).__name__}: {remote.raised}"
    assert_same_history(remote, local)
    assert_same_weights(remote, local)


# -- exceptions ------------------------------------------------------------------------------------
CALLBACK_RAISES = MODEL + """
class Stop(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("stopped by the notebook's callback at epoch 1")
try:
    hist = model.fit(X[:256], y[:256], batch_size=64, epochs=3, shuffle=False, verbose=0, callbacks=[Stop()])
except Exception as exc:
    caught = exc
"""


def test_a_callbacks_exception_reaches_the_cell_unchanged(runs):
    local, remote = runs("callback_raises")
    same_exception(remote.caught, local.caught)


BAD_LOSS = """
import keras, numpy as np
keras.utils.set_random_seed(1)
inputs = keras.Input((64,))
model = keras.Model(inputs, [keras.layers.Dense(10, activation="softmax", name="a")(inputs),
                             keras.layers.Dense(1, name="b")(inputs)])
model.compile("adam", loss={"a": "sparse_categorical_crossentropy", "c": "mse"})
try:
    hist = model.fit(X[:128], [y[:128], y[:128].astype("float32")], batch_size=64, epochs=1, verbose=0)
except Exception as exc:
    caught = exc
"""


def test_keras_own_check_raises_keras_error(runs):
    """A loss dict naming an output the model lacks: Keras' ValueError, its own sentence."""
    local, remote = runs("bad_loss")
    assert isinstance(local.caught, ValueError)
    same_exception(remote.caught, local.caught)


CELLS_ERROR = """
import keras
keras.utils.set_random_seed(1)

class ShapeRefused(Exception):
    pass

class Picky(keras.layers.Layer):
    def call(self, x, training=False):
        if training:
            raise ShapeRefused(f"Picky trains on no batch of shape {tuple(x.shape)[1:]}")
        return x

model = keras.Sequential([keras.Input((64,)), Picky(), keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy")
try:
    hist = model.fit(X[:128], y[:128], batch_size=64, epochs=1, verbose=0)
except Exception as exc:
    caught = exc
"""


def test_an_exception_class_the_cell_defines_comes_back_as_itself(runs):
    """Raised by the cell's layer on a worker: the cell's own class (looked up by name), its own message."""
    local, remote = runs("cells_error")
    assert type(local.caught) is local.ns["ShapeRefused"]
    assert type(remote.caught) is remote.ns["ShapeRefused"], repr(remote.caught)  # the class the cell defined
    # Keras' "Exception encountered when calling Picky.call()" frame, with the arguments it received: a worker's
    # share of the batch where the local call had all of it.
    def batchless(message: str) -> str:
        return re.sub(r"shape=\(\d+,", "shape=(B,", message)

    assert str(local.caught).startswith("Exception encountered when calling Picky.call()")
    assert batchless(str(remote.caught)) == batchless(str(local.caught)), (str(remote.caught), str(local.caught))


BACKUP = MODEL + """
class Interrupt(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("interrupted")
try:
    hist = model.fit(X[:256], y[:256], batch_size=64, epochs=4, shuffle=False, verbose=0,
                     callbacks=[keras.callbacks.BackupAndRestore(OUT + "/backup"), Interrupt()])
except RuntimeError as exc:  # as a retry loop would
    caught = exc
hist = model.fit(X[:256], y[:256], batch_size=64, epochs=4, shuffle=False, verbose=0,
                 callbacks=[keras.callbacks.BackupAndRestore(OUT + "/backup")])
"""


def test_backup_and_restore_interrupt_caught_as_runtime_error_and_resumed(runs):
    local, remote = runs("backup")
    assert isinstance(local.caught, RuntimeError) and local.epochs == [2, 3]
    same_exception(remote.caught, local.caught)
    assert remote.raised is None, remote.raised
    assert_same_history(remote, local)


# -- fit's arguments -------------------------------------------------------------------------------
FIT_SPLIT = MODEL + """
hist = model.fit(x=X[:320], y=y[:320], batch_size=48, epochs=3, verbose=0, validation_split=0.25, shuffle=False,
                 class_weight={c: 1.0 + c / 10 for c in range(10)}, initial_epoch=1, validation_freq=2)
"""
FIT_STEPS = MODEL + """
import numpy as np
hist = model.fit(X[:256], y[:256], batch_size=64, epochs=2, verbose=2, shuffle=False,
                 sample_weight=np.linspace(0.5, 2.0, 256).astype("float32"),
                 validation_data=(Xv[:128], yv[:128], np.linspace(1.0, 2.0, 128).astype("float32")),
                 steps_per_epoch=2, validation_steps=2, validation_batch_size=32)
"""
FIT_SHUFFLED = MODEL + """
hist = model.fit(X[:256], y[:256], batch_size=64, epochs=2, verbose=0, validation_data=(Xv[:128], yv[:128]))
"""
FIT_ARGUMENTS = {
    "x": "fit_split", "y": "fit_split", "batch_size": "fit_split", "epochs": "fit_split", "verbose": "fit_steps",
    "callbacks": "hooks", "validation_split": "fit_split", "validation_data": "fit_steps",
    "shuffle": "fit_shuffled", "class_weight": "fit_split", "sample_weight": "fit_steps",
    "initial_epoch": "fit_split", "steps_per_epoch": "fit_steps", "validation_steps": "fit_steps",
    "validation_batch_size": "fit_steps", "validation_freq": "fit_split",
}


@pytest.mark.parametrize("argument", sorted(FIT_ARGUMENTS))
def test_fit_argument_as_locally(runs, argument):
    """Each of fit's arguments (several share a run): the local History and weights; shuffled, the same
    History entries and epochs (the order differs)."""
    local, remote = runs(FIT_ARGUMENTS[argument])
    assert remote.raised is None, f"{type(remote.raised).__name__}: {remote.raised}"
    if argument == "shuffle":
        assert sorted(remote.history) == sorted(local.history) and remote.epochs == local.epochs
        return
    assert_same_history(remote, local)
    assert_same_weights(remote, local)


# -- as many workers as the data allow ---------------------------------------------------------------
BATCH_OF_ONE = MODEL + """
hist = model.fit(X[:12], y[:12], batch_size=1, epochs=2, shuffle=False, verbose=0, validation_data=(Xv[:5], yv[:5]))
"""


def test_a_batch_of_one_row_trains_on_one_worker_as_locally(runs):
    """batch_size=1 under --workers 2: one worker (its step is the local step), said in one line."""
    local, remote = runs("batch_of_one")
    assert remote.raised is None, f"{type(remote.raised).__name__}: {remote.raised}"
    assert_same_history(remote, local)
    assert_same_weights(remote, local)
    assert [s for s in remote.said if "1 worker instead of 2" in s and "batch_size=1" in s], remote.said


SHORT_LAST_BATCH = MODEL + """
hist = model.fit(X[:65], y[:65], batch_size=64, epochs=2, shuffle=False, verbose=0, validation_data=(Xv[:1], yv[:1]))
"""


def test_a_last_batch_and_validation_of_fewer_rows_than_workers_as_locally(runs):
    """65 rows in batches of 64 on 2 workers: the last batch's one row leaves a worker out of that step, and
    the one validation row leaves a worker without any; History (val_* too) and weights are the local ones."""
    local, remote = runs("short_last_batch")
    assert remote.raised is None, f"{type(remote.raised).__name__}: {remote.raised}"
    assert "val_loss" in local.history
    assert_same_history(remote, local)
    assert_same_weights(remote, local)
    assert not [s for s in remote.said if "instead of" in s], remote.said


# -- what Keras was given ------------------------------------------------------------------------------
REQUIRED_NONE = """
import keras, numpy as np
inputs = keras.Input((64,), name="pixels")
model = keras.Model(inputs, keras.layers.Dense(1)(inputs))
model.compile("sgd", "mse")
try:
    hist = model.fit([None], y[:64].astype("float32"), epochs=1, verbose=0)
except Exception as exc:
    caught = exc
"""


def test_none_for_a_required_input_raises_keras_error(runs):
    local, remote = runs("required_none")
    assert isinstance(local.caught, ValueError)
    same_exception(remote.caught, local.caught)


NESTED_LOSSES = """
import keras
keras.utils.set_random_seed(1)
inputs = keras.Input((64,))
heads = [keras.layers.Dense(1, name=name)(inputs) for name in ("a", "b", "c")]
model = keras.Model(inputs, (heads[0], [heads[1], heads[2]]))
model.compile(keras.optimizers.SGD(0.01), loss=("mse", ["mae", "mse"]))
target = y[:128].astype("float32")[:, None]
hist = model.fit(X[:128], (target, [target, target]), batch_size=32, epochs=2, shuffle=False, verbose=0)
"""


def test_a_tuple_of_losses_holding_a_list_as_locally(runs):
    """compile(loss=(l1, [l2, l3])): the workers get the structure Keras was given, not TensorFlow's wrappers."""
    local, remote = runs("nested_losses")
    assert remote.raised is None, f"{type(remote.raised).__name__}: {remote.raised}"
    assert_same_history(remote, local)
    assert_same_weights(remote, local)


OWN_COMPUTE_LOSS = """
import keras
keras.utils.set_random_seed(1)
class TwoLosses(keras.Model):
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, **kwargs):
        return super().compute_loss(x=x, y=y, y_pred=[y_pred, y_pred], sample_weight=sample_weight, **kwargs)
inputs = keras.Input((64,))
model = TwoLosses(inputs, keras.layers.Dense(1)(inputs))
model.compile(keras.optimizers.SGD(0.01), loss=["mse", "mae"])
target = y[:128].astype("float32")[:, None]
hist = model.fit(X[:128], (target, target), batch_size=32, epochs=2, shuffle=False, verbose=0)
"""


def test_a_models_own_compute_loss_meets_the_labels_as_locally(runs):
    """One output made two by the model's compute_loss, two losses: its code decides, as in Keras' fit."""
    local, remote = runs("own_compute_loss")
    assert remote.raised is None, f"{type(remote.raised).__name__}: {remote.raised}"
    assert_same_history(remote, local)
    assert_same_weights(remote, local)


# -- ragged inputs (TensorFlow) -------------------------------------------------------------------------
RAGGED = """
import keras, numpy as np, tensorflow as tf
class RaggedMean(keras.layers.Layer):
    def call(self, t):  # the mean over each row's own length
        return tf.reduce_mean(t, axis=1)
tokens = lambda rows: tf.ragged.constant([np.flatnonzero(r > 0.25) for r in rows], dtype="int32")
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.layers.Embedding(64, 8), RaggedMean(), keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
hist = model.fit(tokens(X[:256]), y[:256], batch_size=48, epochs=2, shuffle=False, verbose=0,
                 validation_data=(tokens(Xv[:96]), yv[:96]))
"""


def test_ragged_inputs_train_validate_evaluate_and_predict_as_locally(runs):
    """A tf.RaggedTensor x (the bright pixels' positions, rows of different lengths) to an Embedding and a
    layer reducing over each row's length: fit with ragged validation data gives the local History and
    weights; nbdist.evaluate and nbdist.predict on it give what Keras' evaluate and predict give."""
    local, remote = runs("ragged")
    assert remote.raised is None, f"{type(remote.raised).__name__}: {remote.raised}"
    assert np.isfinite(local.history["loss"]).all() and np.isfinite(local.history["val_loss"]).all()
    assert_same_history(remote, local)
    assert_same_weights(remote, local)
    model, x, labels = remote.ns["model"], remote.ns["tokens"](remote.ns["Xv"][:150]), remote.ns["yv"][:150]
    want = model.evaluate(x, labels, batch_size=32, verbose=0, return_dict=True)
    got = nbdist.evaluate(model, x, labels, batch_size=32, workers=2)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
    np.testing.assert_allclose(nbdist.predict(model, x, workers=2), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6)


def test_predict_of_ragged_outputs_is_a_ragged_tensor_as_keras():
    """A model whose output is ragged (as in Keras' own ragged test, x times a weight): nbdist.predict joins
    the workers' rows into the tf.RaggedTensor Keras' predict returns."""
    import tensorflow as tf

    class Twice(keras.Model):
        def __init__(self):
            super().__init__()
            self.scale = self.add_weight(shape=(), initializer=keras.initializers.Constant(2.0))

        def call(self, x):
            return x * self.scale

    x = tf.ragged.constant([[1.0], [2.0, 3.0], [], [4.0, 5.0, 6.0], [7.0]])
    model = Twice()
    want = model.predict(x, verbose=0)
    got = nbdist.predict(model, x, workers=2, batch_size=2)
    assert type(got) is type(want) is tf.RaggedTensor
    assert got.to_list() == want.to_list()


CELLS = {
    "hooks": (HOOKS, {}),
    "built_ins": (BUILT_INS, {"OPTIMIZER": lambda: keras.optimizers.Adam(0.05)}),
    "batch_summaries": (BATCH_SUMMARIES, {}),
    "lr_schedule": (LR_SCHEDULE, {}),
    "reduce_lr": (REDUCE_LR, {}),
    "ema": (EMA, {"OPTIMIZER": lambda: keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9)}),
    "ema_misuse": (EMA_MISUSE, {}),
    "ema_wrapped": (EMA_WRAPPED, {"OPTIMIZER": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9))}),
    "array_metric": (ARRAY_METRIC, {}),
    "eager_one_weight": (EAGER_ONE_WEIGHT, {}),
    "nan": (NAN, {"RAISE": False}),
    "nan_raise": (NAN, {"RAISE": True}),
    "callback_raises": (CALLBACK_RAISES, {}),
    "bad_loss": (BAD_LOSS, {}),
    "cells_error": (CELLS_ERROR, {}),
    "backup": (BACKUP, {}),
    "fit_split": (FIT_SPLIT, {}),
    "fit_steps": (FIT_STEPS, {}),
    "fit_shuffled": (FIT_SHUFFLED, {}),
    "batch_of_one": (BATCH_OF_ONE, {}),
    "short_last_batch": (SHORT_LAST_BATCH, {}),
    "required_none": (REQUIRED_NONE, {}),
    "nested_losses": (NESTED_LOSSES, {}),
    "own_compute_loss": (OWN_COMPUTE_LOSS, {}),
    "ragged": (RAGGED, {}),
}


# -- evaluate and predict ----------------------------------------------------------------------------
def compiled_mlp(seed: int = 1):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_evaluate_arguments_as_keras(digits):
    """sample_weight, steps (with batch_size) and return_dict as model.evaluate takes them."""
    x, y = digits[0][:300], digits[1][:300]
    weights = np.linspace(0.5, 2.0, len(x)).astype("float32")
    model = compiled_mlp()
    want = model.evaluate(x, y, sample_weight=weights, verbose=0, return_dict=True)
    got = nbdist.evaluate(model, x, y, sample_weight=weights, workers=2)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key
    want_steps = model.evaluate(x, y, batch_size=64, steps=2, verbose=0)
    got_steps = nbdist.evaluate(model, x, y, batch_size=64, steps=2, return_dict=False, workers=2)
    np.testing.assert_allclose(got_steps, want_steps, rtol=1e-5)


Pair = collections.namedtuple("Pair", ["probs", "score"])


def structured_model(kind: str):
    inputs = keras.Input((64,))
    probs = keras.layers.Dense(10, activation="softmax")(inputs)
    score = keras.layers.Dense(1)(inputs)
    outputs = {"tuple": (probs, score), "dict": {"probs": probs, "score": score}}.get(kind)
    if kind == "namedtuple":
        outputs = Pair(probs, score)
    keras.utils.set_random_seed(2)
    return keras.Model(inputs, outputs)


@pytest.mark.parametrize("kind", ["tuple", "namedtuple", "dict"])
def test_predict_returns_the_models_output_structure(digits, kind):
    x = digits[0][:100]
    model = structured_model(kind)
    want = model.predict(x, verbose=0)
    got = nbdist.predict(model, x, workers=2)
    assert type(got) is type(want), (type(got), type(want))
    for a, b in zip(keras.tree.flatten(got), keras.tree.flatten(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_evaluate_and_predict_leave_no_socket_open(digits):
    x, y = digits[0][:100], digits[1][:100]
    model = compiled_mlp()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", ResourceWarning)
        nbdist.evaluate(model, x, y, workers=2)
        nbdist.predict(model, x, workers=2)
        gc.collect()
    leaked = [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)]
    assert not leaked, leaked


def test_evaluate_and_predict_build_an_unbuilt_model_as_keras(digits):
    x, y = digits[0][:100], digits[1][:100]
    local, remote = [keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
                     for _ in range(2)]
    for model in (local, remote):
        keras.utils.set_random_seed(3)
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    want = local.evaluate(x, y, verbose=0, return_dict=True)
    got = nbdist.evaluate(remote, x, y, workers=2)
    assert remote.built and len(remote.weights) == len(local.weights) == 4  # built on the data, as Keras builds
    # Each was built with its own draw of initial weights: compare with Keras' own evaluate of the same weights.
    assert got["loss"] == pytest.approx(remote.evaluate(x, y, verbose=0, return_dict=True)["loss"], rel=1e-5)
    assert want["loss"] > 0
    unbuilt = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])
    got_rows = nbdist.predict(unbuilt, x, workers=2)
    np.testing.assert_allclose(got_rows, unbuilt.predict(x, verbose=0), rtol=1e-5)
