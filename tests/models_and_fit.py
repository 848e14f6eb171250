"""Issues 16 and 17 on the remote backends: the pieces the Spark and container tests share.

A notebook-defined loss with a subclassed model (issue 16), and an unchanged cell's own ``model.fit``
with callbacks and ``class_weight`` (issue 17), checked against the same code run locally.
"""
from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np

from .conftest import relative_error

LOSS_OFFSET = 10.0


def penalty_model_class() -> Any:
    """keras.io's "Customizing what happens in fit()": a subclassed model with its own train_step and
    metric. Defined inside a function, like a notebook's class it cannot be imported by name on a
    worker, an executor or in a container: it has to travel by value."""
    import keras
    import tensorflow as tf

    class PenaltyModel(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.hidden = keras.layers.Dense(32, activation="relu")
            self.head = keras.layers.Dense(10, activation="softmax")
            self.loss_tracker = keras.metrics.Mean(name="loss")
            self.penalty = keras.metrics.Mean(name="penalty")

        def call(self, x):
            return self.head(self.hidden(x))

        def train_step(self, data):
            x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
            self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
            self.loss_tracker.update_state(loss)
            self.penalty.update_state(tf.reduce_mean(tf.square(self.head.kernel)))
            return {"loss": self.loss_tracker.result(), "penalty": self.penalty.result()}

        @property
        def metrics(self):
            return [self.loss_tracker, self.penalty]

    return PenaltyModel


def notebook_subclassed_model(seed: int) -> Any:
    """The subclassed model built with ``build()`` (its layers have no weights until it is called),
    compiled with a plain-function loss defined here: all of it travels by value."""
    import keras

    def offset_loss(y_true, y_pred):
        # The usual loss plus a constant (same gradients): the history shows this function was used.
        return keras.losses.sparse_categorical_crossentropy(y_true, y_pred) + LOSS_OFFSET

    keras.utils.set_random_seed(seed)
    model = penalty_model_class()()
    model.build((None, 64))
    model.compile(keras.optimizers.Adam(0.01), offset_loss)
    return model


def accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    return float((model.predict(x, verbose=0).argmax(1) == y).mean())


def check_subclassed_run(job: Any, model: Any, local: Any, x_test: np.ndarray, y_test: np.ndarray,
                         epochs: int) -> None:
    """The remote run used the notebook's train_step and loss and left the workers' weights in the model:
    test accuracy within 1 point of the same model trained locally with the same global batch."""
    got, local_acc = accuracy(model, x_test, y_test), accuracy(local, x_test, y_test)
    assert got >= local_acc - 0.01, (got, local_acc)
    # The notebook's loss, not a stand-in: every epoch's loss carries its offset.
    assert all(LOSS_OFFSET < loss < LOSS_OFFSET + 2.5 for loss in job.history["loss"]), job.history["loss"]
    assert set(job.history) == {"loss", "penalty"}  # the model's own train_step ran remotely
    assert len(job.history["loss"]) == epochs
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), job._last_weights[1]))


# The cell as a user writes it for local training; under %%dist_train its fit runs on the workers.
# Adam with allreduce: each step applies the mean gradient of the global batch, as local fit does,
# so the two runs (and EarlyStopping's decision) agree to float rounding.
# The start of a cell with callbacks: a notebook callback recording each epoch's weights, and the model.
SEEN_AND_MODEL = """
import keras
class Seen(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = {}
    def on_epoch_end(self, epoch, logs=None):
        self.weights[epoch] = [w.copy() for w in self.model.get_weights()]
seen = Seen()
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.02), "sparse_categorical_crossentropy", metrics=["accuracy"])
"""
FIT_CELL = SEEN_AND_MODEL + """
history = model.fit(X, y, batch_size=64, epochs=25, validation_data=(Xv, yv), verbose=0, shuffle=False,
                    class_weight=CLASS_WEIGHT, callbacks=[
                        keras.callbacks.EarlyStopping(monitor="val_loss", patience=2, restore_best_weights=True),
                        keras.callbacks.CSVLogger(CSV), seen])
"""

# Heavily skewed towards two classes: the trained weights differ clearly from an unweighted fit.
CLASS_WEIGHT = {c: (8.0 if c in (3, 8) else 0.5) for c in range(10)}


def run_fit_cell(ip: Any, magic_line: str | None, csv_path: Path, class_weight: dict | None) -> dict[str, Any]:
    """Run FIT_CELL under the magic (or locally when magic_line is None); the names it left behind."""
    ip.user_ns.update(CSV=str(csv_path), CLASS_WEIGHT=class_weight)
    if magic_line is None:
        result = ip.run_cell(FIT_CELL)
        result.raise_error()
    else:
        ip.run_cell_magic("dist_train", magic_line, FIT_CELL)
    ns = ip.user_ns
    return {"history": ns["history"].history, "weights": ns["model"].get_weights(), "seen": ns["seen"].weights,
            "job": ns.get("history_job")}


def check_intercepted_fit(ip: Any, magic_line: str, tmp_path: Path) -> None:
    """The cell's fit on the remote backend stops at the epoch the merged history dictates, restores the
    best epoch's weights, writes one CSV row per epoch here, and applies class_weight: everything equals
    the same cell run locally, which differs from an unweighted run."""
    remote = run_fit_cell(ip, magic_line, tmp_path / "remote.csv", CLASS_WEIGHT)
    assert remote["job"] is not None and remote["job"].status == "done"
    val_loss = remote["history"]["val_loss"]
    epochs = len(val_loss)
    assert epochs < 25, "EarlyStopping never fired; the test needs it to"
    best = int(np.argmin(val_loss))
    assert epochs - 1 - best == 2  # patience 2, acted on the merged val_loss
    for rank, report in remote["job"].reports.items():
        assert report["last_epoch"] == epochs - 1, rank  # every worker stopped at that epoch
    assert relative_error(remote["weights"], remote["seen"][best]) == 0.0  # the best epoch restored
    with open(tmp_path / "remote.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == list(range(epochs))
    np.testing.assert_allclose([float(r["val_loss"]) for r in rows], val_loss, rtol=1e-6)

    local = run_fit_cell(ip, None, tmp_path / "local.csv", CLASS_WEIGHT)
    assert len(local["history"]["val_loss"]) == epochs  # the same stop epoch as local fit
    np.testing.assert_allclose(val_loss, local["history"]["val_loss"], rtol=1e-5)
    err = relative_error(remote["weights"], local["weights"])
    assert err < 1e-5, err  # measured 4e-7 on Spark and in containers
    unweighted = run_fit_cell(ip, None, tmp_path / "plain.csv", None)
    assert relative_error(unweighted["weights"], local["weights"]) > 1e-2  # class_weight matters here
