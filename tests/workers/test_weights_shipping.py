"""Rank 0 sends the weights to the notebook only when something there reads them (issue 18).

Every epoch for a checkpoint or a callback that may read the model (ModelCheckpoint, a notebook's
own callback); otherwise once, at the end, or when the run is stopped. The trained model is the
same either way.
"""
import keras
import numpy as np
import pytest

import nbdist
from nbdist.driver.callbacks import DriverCallbacks

from ..conftest import mlp

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leftover_workers")]
EPOCHS = 3


def _train(digits, **kwargs):
    x, y = digits[0][:600], digits[1][:600]
    model = mlp(seed=3)
    job = nbdist.train(model, x, y, epochs=EPOCHS, batch_size=32, workers=2, shuffle=False, seed=1, **kwargs)
    return model, job


def test_weights_go_once_without_readers_and_every_epoch_for_a_checkpoint_with_the_same_result(digits, tmp_path):
    plain_model, plain = _train(digits)  # no callback, no checkpoint
    assert plain.reports[0]["weights_sent"] == 1 and plain.weights_epoch == EPOCHS - 1
    # Both runs as an intercepted fit (the same batches): one with a callback that reads only the logs.
    log_csv = str(tmp_path / "log.csv")
    once_model, once = _train(digits, callbacks=[keras.callbacks.CSVLogger(log_csv)])
    ckpt = str(tmp_path / "last.weights.h5")
    every_model, every = _train(digits, callbacks=[keras.callbacks.CSVLogger(log_csv),
                                                   keras.callbacks.ModelCheckpoint(ckpt, save_weights_only=True)])
    assert once.reports[0]["weights_sent"] == 1  # at the end only
    assert every.reports[0]["weights_sent"] == EPOCHS
    assert "weights_sent" not in once.reports[1]  # only rank 0 sends them
    for a, b in zip(once_model.get_weights(), every_model.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert once.history["loss"] == every.history["loss"]
    # The checkpoint written at the last epoch holds the weights the notebook's model got.
    saved = mlp(seed=0)
    saved.load_weights(ckpt)
    for a, b in zip(saved.get_weights(), every_model.get_weights()):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_dir_gets_the_weights_every_epoch(digits, tmp_path):
    _, job = _train(digits, checkpoint_dir=str(tmp_path / "ckpt"), strategy="allreduce")
    assert job.reports[0]["weights_sent"] == EPOCHS


class PeekAtWeights(keras.callbacks.Callback):
    """A notebook's callback: it may read the model, so the weights come every epoch."""

    def __init__(self):
        super().__init__()
        self.first_kernel_sums = []

    def on_epoch_end(self, epoch, logs=None):
        self.first_kernel_sums.append(float(np.sum(self.model.get_weights()[0])))


def test_a_notebook_callback_sees_each_epochs_weights(digits):
    peek = PeekAtWeights()
    _, job = _train(digits, callbacks=[peek, keras.callbacks.CSVLogger("/dev/null")])
    assert job.reports[0]["weights_sent"] == EPOCHS
    assert len(set(peek.first_kernel_sums)) == EPOCHS  # a new model at every epoch


def test_only_keras_callbacks_that_read_logs_alone_spare_the_weights():
    cbs = keras.callbacks
    model = mlp(seed=0)

    def needs(*callbacks):
        return DriverCallbacks(model, list(callbacks), epochs=1).needs_model

    assert not needs()
    assert not needs(cbs.EarlyStopping(patience=2), cbs.CSVLogger("/dev/null"), cbs.ReduceLROnPlateau(),
                     cbs.LearningRateScheduler(lambda e, lr: lr), cbs.TerminateOnNaN())
    assert needs(cbs.EarlyStopping(restore_best_weights=True))
    assert needs(cbs.ModelCheckpoint("/tmp/x.keras"))
    assert needs(PeekAtWeights())

    class QuietStopping(cbs.EarlyStopping):  # a subclass may read anything
        pass

    assert needs(QuietStopping())


def test_a_stopped_run_asks_rank_0_for_the_last_finished_epochs_weights(digits):
    """Weights are not sent every epoch here, yet a stop leaves the model with the last epoch's."""
    import time

    x, y = digits
    model = mlp(seed=0)
    before = [w.copy() for w in model.get_weights()]
    job = nbdist.train(model, x, y, epochs=500, batch_size=32, workers=2, background=True, ui="none")
    deadline = time.monotonic() + 120
    while job.state.epochs_done < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    job.stop()
    assert job.status == "stopped"
    assert job.weights_epoch is not None and job.weights_epoch >= 1
    assert not all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
