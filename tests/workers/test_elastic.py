"""Elastic runs (issue 48, docs/elastic.md): workers="MIN:MAX" under allreduce on local workers.

One run of 3 workers loses one to SIGKILL in its second epoch and finishes with the other two; it is
compared with the fault-free runs of the same membership schedule (3 workers for the first epoch, then 2
with the same global batch from the committed state). Below MIN the run fails as any run does.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from nbdist.api import prepare
from nbdist.config import TrainConfig
from nbdist.errors import NbdistError, TrainingFailed

from ..conftest import wait_no_workers

EPOCHS = 3
BATCH = 32  # per worker at launch: a global batch of 96 on 3 workers, 48 + 48 once 2 are left


def _model(layers=()):
    import keras

    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((64,)), *layers, keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


class DieOnce:
    """An identity layer whose worker process kills itself (SIGKILL) at its ``at``-th training step: the first
    worker to get there, once per ``marker`` file. The driver sees events too late to kill mid-epoch."""

    @staticmethod
    def layer(marker: str, at: int):
        import keras
        import tensorflow as tf

        class Die(keras.layers.Layer):
            def __init__(self, **kwargs):
                super().__init__(**kwargs)
                self.calls = 0

            def tick(self):
                self.calls += 1
                if self.calls == at:
                    try:
                        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                    except FileExistsError:
                        return
                    os.kill(os.getpid(), signal.SIGKILL)

            def call(self, x, training=None):
                if training:
                    tf.py_function(self.tick, [], [])
                return x

        return Die()


def _killer(victim: int, after_epochs: int, killed: dict):
    """Kill worker ``victim`` (launch rank) once ``after_epochs`` epochs are merged (the workers are then past it)."""

    def listener(kind, state, payload):
        if kind == "epoch" and not killed and state.epochs_done >= after_epochs:
            killed["pid"] = state.workers[victim].pid
            killed["at"] = time.monotonic()
            os.kill(killed["pid"], signal.SIGKILL)

    return listener


def test_a_killed_worker_costs_steps_not_the_run(digits, capsys, tmp_path):
    x, y = digits
    common = dict(batch_size=BATCH, shuffle=False, seed=7, ui="text")
    steps_per_epoch = -(-len(x) // 3 // BATCH)
    marker = str(tmp_path / "died")
    model = _model([DieOnce.layer(marker, steps_per_epoch + 6)])  # in the 6th step of the second epoch
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"):  # tracked: the change is a tag of the run
        job = prepare(model, TrainConfig(epochs=EPOCHS, workers="2:3", mlflow=True, **common), x, y, None)
        (tracker,) = [t for t in job.listeners if type(t).__name__ == "RunTracker"]
        tracker.log_model = False  # saving the model for MLflow (tests/workers/test_tracking.py) costs a minute
        job.start()
        history = job.wait(timeout=300)
        client = mlflow.MlflowClient()
        (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
        losses = client.get_metric_history(run.info.run_id, "loss")
    out = capsys.readouterr().out

    assert job.status == "done" and os.path.exists(marker)
    assert [len(v) for v in history.values()] == [EPOCHS] * len(history)  # one per epoch, none twice
    (change,) = job.state.membership
    (gone,) = change.left
    assert "SIGKILL" in change.why and change.workers == [r for r in range(3) if r != gone]
    assert change.committed == 1  # the commit at the second epoch's start
    # Killed mid-epoch: the 5 steps of that epoch before the one it died in, or 6 where its dying step's
    # gradients were already summed (the step's ops are not ordered after the layer's).
    assert 5 <= change.steps_lost <= 6
    assert job.state.world_size == 2
    assert "elastic: goes on while 2 are left" in out.splitlines()[0]
    assert sum(f"worker {gone} left (was killed by SIGKILL)" in line for line in out.splitlines()) == 1
    assert len(job.reports) == 2  # the survivors' closing reports
    assert run.data.params["workers"] == "2:3" and run.data.tags["nbdist.membership.0"] == change.line
    assert sorted(m.step for m in losses) == list(range(EPOCHS))  # one step per epoch, none twice
    assert not wait_no_workers(5)

    # The same membership schedule without a fault: 3 workers for an epoch, then 2 from that state with the
    # launch's global batch (the allreduce step is the local step on the global batch throughout).
    reference = _model([DieOnce.layer(marker, 1)])  # the marker is there: nobody dies
    first = prepare(reference, TrainConfig(epochs=1, workers=3, **{**common, "ui": "none"}), x, y, None)
    first.start()
    first.wait(timeout=300)
    rest = prepare(reference, TrainConfig(epochs=EPOCHS - 1, workers=2, batch_size=3 * BATCH // 2, shuffle=False,
                                          seed=7, ui="none"), x, y, None)
    rest.start()
    rest_history = rest.wait(timeout=300)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history["loss"][1:], rest_history["loss"], rtol=1e-5)


def test_a_commit_every_k_steps_costs_at_most_k(digits, capsys, tmp_path):
    """Killed in the 10th step of the second epoch with a commit every 4 steps: the survivors resume that epoch
    after its 8th step, on its remaining global batches, so the run is the fault-free one with 3 workers for two
    epochs and 2 for the third, and the second epoch's merged metrics cover all of it."""
    x, y = digits
    k, common = 4, dict(batch_size=BATCH, shuffle=False, seed=7, ui="none")
    steps_per_epoch = -(-len(x) // 3 // BATCH)
    marker = str(tmp_path / "died")
    model = _model([DieOnce.layer(marker, steps_per_epoch + 10)])
    job = prepare(model, TrainConfig(epochs=EPOCHS, workers="2:3", commit_every=k, **{**common, "ui": "text"}),
                  x, y, None)
    job.start()
    history = job.wait(timeout=300)
    out = capsys.readouterr().out

    assert job.status == "done" and os.path.exists(marker)
    assert [len(v) for v in history.values()] == [EPOCHS] * len(history)
    (change,) = job.state.membership
    assert (change.committed, change.step) == (1, 8)  # the commit after the second epoch's 8th step
    assert 1 <= change.steps_lost <= k
    assert "from the commit after epoch 1 and 8 steps of the next" in out

    reference = _model([DieOnce.layer(marker, 1)])  # the marker is there: nobody dies
    first = prepare(reference, TrainConfig(epochs=2, workers=3, **common), x, y, None)
    first.start()
    first_history = first.wait(timeout=300)
    rest = prepare(reference, TrainConfig(epochs=EPOCHS - 2, workers=2, **{**common, "batch_size": 3 * BATCH // 2}),
                   x, y, None)
    rest.start()
    rest_history = rest.wait(timeout=300)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The second epoch, trained by two generations, is merged over all of its steps.
    for name in ("loss", "accuracy"):
        np.testing.assert_allclose(history[name], first_history[name] + rest_history[name], rtol=1e-5)
    assert not wait_no_workers(5)


def test_below_min_fails_as_any_run(digits):
    x, y = digits
    killed: dict = {}
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    job = prepare(model, TrainConfig(epochs=200, workers="2:2", batch_size=BATCH, ui="none"), x, y, None,
                  listeners=[_killer(1, 1, killed)])
    job.start()
    with pytest.raises(TrainingFailed) as info:
        job.wait(timeout=120)
    took = time.monotonic() - killed["at"]
    assert f"worker 1 (pid {killed['pid']})" in str(info.value) and "SIGKILL" in str(info.value)
    assert "fewer than the 2 that --workers 2:2 needs" in str(info.value)
    assert job.state.membership == []
    assert took < 10, took  # as fast as any run's failure
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert not wait_no_workers(5)


def test_the_run_starts_with_the_workers_that_start(digits, capsys):
    x, y = digits
    job = prepare(_model(), TrainConfig(epochs=1, workers="2:3", batch_size=BATCH, ui="text"), x, y, None)
    job.start()
    os.kill(job._handles[2].proc.pid, signal.SIGKILL)  # before the first pump: no job has gone out yet
    history = job.wait(timeout=300)
    out = capsys.readouterr().out.splitlines()
    assert job.status == "done" and len(history["loss"]) == 1
    (change,) = job.state.membership
    assert change.left == [2] and change.workers == [0, 1] and not change.started and change.steps_lost == 0
    assert "worker 2 did not start (was killed by SIGKILL during training); training with 2 workers" in out[1]
    assert sorted(job.reports) == [0, 1] and job.state.world_size == 2
    assert job.state.workers[0].batches == -(-len(x) // 2 // (3 * BATCH // 2))  # the launch's global batch


@pytest.mark.parametrize("options, words", [
    ({"workers": "3:2"}, "1 <= MIN <= MAX"),
    ({"workers": "two"}, "MIN:MAX"),
    ({"workers": "2:3", "strategy": "averaging"}, "allreduce"),
    ({"workers": "2:3", "commit_every": 0}, "commit_every must be a positive number of steps"),
    ({"workers": 3, "commit_every": 10}, "commit_every applies to an elastic run"),
])
def test_workers_range_is_checked_at_the_door(options, words):
    with pytest.raises(NbdistError, match=words):
        TrainConfig(**options)


@pytest.mark.parametrize("workers, words", [
    ("3:2", "workers MIN:MAX needs 1 <= MIN <= MAX, got 3:2"),
    ("2:3 --strategy averaging", "(elastic) trains under allreduce"),  # 2:3 read as elastic
    ("3 --commit-every 5", "commit_every applies to an elastic run"),
])
def test_the_magic_takes_workers_min_max(ip, workers, words):
    result = ip.run_cell(f"%%dist_train --data X,y --workers {workers} --ui none\n"
                         "import keras\nm = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])\n"
                         "m.compile('sgd', 'mse')\n")
    assert not result.success and words in str(result.error_in_exec)
    assert "Traceback" not in str(result.error_in_exec)
