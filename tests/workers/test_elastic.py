"""Elastic runs (issue 48, docs/elastic.md): workers="MIN:MAX" under allreduce on local workers.

One run of 3 workers loses one to SIGKILL in its second epoch, goes on with the other two, and a replacement
joins them at the next commit; it is compared with the fault-free runs of the same membership schedule (3
workers for the first epoch, 2 with the same global batch from the committed state for the second, 3 again).
Below MIN the run fails as any run does.
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

from ..conftest import run_ranks, wait_no_workers

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
    worker to get there, once per ``marker`` file. The driver sees events too late to kill mid-epoch. ``parent``:
    it kills its parent first (a Spark task's Python process, which the worker dies with), then itself there and
    then: the PR_SET_PDEATHSIG its parent's death sends came 1 to 13 steps later under load (why so late was not
    pinned down), and a test's step must not depend on that. ``sig``: another signal (SIGSTOP: alive and silent,
    as a worker whose host is cut off)."""

    @staticmethod
    def layer(marker: str, at: int, parent: bool = False, sig: int = signal.SIGKILL):
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
                    if parent:
                        os.kill(os.getppid(), signal.SIGKILL)
                    os.kill(os.getpid(), sig)

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


@pytest.fixture(scope="module")
def schedule_reference(digits, tmp_path_factory):
    """Fault-free runs of the schedule a loss in the second epoch and a join at the third's start make: 3 workers
    for an epoch, 2 for the next from that state with the launch's global batch, 3 again (the allreduce step is
    the local step on the global batch throughout). The final weights and each epoch's loss."""
    x, y = digits
    reference = _model([DieOnce.layer(str(tmp_path_factory.mktemp("ref")), 1)])  # a directory: nobody dies
    losses = []
    for workers, batch in ((3, BATCH), (2, 3 * BATCH // 2), (3, BATCH)):
        part = prepare(reference, TrainConfig(epochs=1, workers=workers, batch_size=batch, shuffle=False, seed=7,
                                              ui="none"), x, y, None)
        part.start()
        losses += part.wait(timeout=300)["loss"]
    return reference.get_weights(), losses


def assert_schedule(model, history, reference) -> None:
    weights, losses = reference
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(history["loss"], losses, rtol=1e-5)


def test_a_killed_worker_costs_steps_not_the_run_and_is_replaced(digits, capsys, tmp_path, schedule_reference):
    x, y = digits
    common = dict(batch_size=BATCH, shuffle=False, seed=7, ui="text")
    steps_per_epoch = -(-len(x) // 3 // BATCH)
    marker = str(tmp_path / "died")
    model = _model([DieOnce.layer(marker, steps_per_epoch + 6)])  # in the 6th step of the second epoch
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _use_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"):  # tracked: each change is a tag of the run
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
    lost, joined = job.state.membership
    (gone,) = lost.left
    survivors = [r for r in range(3) if r != gone]
    assert "SIGKILL" in lost.why and lost.workers == survivors and lost.joined == []
    assert lost.committed == 1  # the commit at the second epoch's start
    # Killed mid-epoch: the 5 steps of that epoch before the one it died in, or 6 where its dying step's
    # gradients were already summed (the step's ops are not ordered after the layer's).
    assert 5 <= lost.steps_lost <= 6
    # Its replacement, started once the two trained again, joined at their next commit: the third epoch's start.
    assert (joined.left, joined.joined, joined.workers, joined.committed) == ([], [3], [*survivors, 3], 2)
    assert joined.line == "worker 3 joined at the commit after epoch 2; training with 3 workers"
    assert job.state.world_size == 3 and len(job.state.workers) == 4
    assert "elastic: goes on while 2 are left" in out.splitlines()[0]
    assert sum(f"worker {gone} left (was killed by SIGKILL)" in line for line in out.splitlines()) == 1
    assert f"nbdist: {joined.line}" in out.splitlines()
    assert sorted(job.reports) == [*survivors, 3]  # the closing reports of the generation that finished
    assert run.data.params["workers"] == "2:3" and run.data.tags["nbdist.membership.0"] == lost.line
    assert run.data.tags["nbdist.membership.1"] == joined.line
    assert sorted(m.step for m in losses) == list(range(EPOCHS))  # one step per epoch, none twice
    assert not wait_no_workers(5)
    assert_schedule(model, history, schedule_reference)  # the same membership schedule without a fault


def test_a_silent_worker_is_taken_for_lost_and_replaced(digits, capsys, tmp_path, schedule_reference):
    """A worker stopped (SIGSTOP) in the second epoch is alive and silent, as one whose host is cut off: past
    heartbeat_timeout the driver takes it for lost and ends it, the others leave the sum they wait in, roll back
    and go on, and its replacement joins at the next commit: the schedule of the killed worker's run."""
    x, y = digits
    steps_per_epoch = -(-len(x) // 3 // BATCH)
    marker = str(tmp_path / "stopped")
    model = _model([DieOnce.layer(marker, steps_per_epoch + 6, sig=signal.SIGSTOP)])
    job = prepare(model, TrainConfig(epochs=EPOCHS, workers="2:3", batch_size=BATCH, shuffle=False, seed=7,
                                     ui="text", heartbeat_interval=0.5, heartbeat_timeout=6), x, y, None)
    job.start()
    history = job.wait(timeout=300)
    out = capsys.readouterr().out

    assert job.status == "done" and os.path.exists(marker)
    assert [len(v) for v in history.values()] == [EPOCHS] * len(history)
    lost, joined = job.state.membership
    (gone,) = lost.left
    assert lost.why.startswith("sent nothing for ") and "its host cut off, or it hung" in lost.why
    # As above, 5 or 6; 7 seen once in a loaded suite run (session 25): the worker stops inside its step's ops, and
    # where TensorFlow had sent on its next step's sum by then was not pinned down. A rollback past the commit
    # would lose 19 or more.
    assert lost.committed == 1 and 5 <= lost.steps_lost <= 7
    assert (joined.left, joined.joined, joined.committed) == ([], [3], 2)
    assert sum(f"worker {gone} left (sent nothing for" in line for line in out.splitlines()) == 1
    assert not wait_no_workers(5)  # the stopped worker was ended, not left behind
    assert_schedule(model, history, schedule_reference)


def test_a_commit_every_k_steps_costs_at_most_k(digits, capsys, tmp_path):
    """Killed in the 10th step of the second epoch with a commit every 4 steps: the survivors resume that epoch
    after its 8th step, on its remaining global batches, and the replacement joins them at a later commit, so the
    run is the fault-free one with 3 workers for two epochs and 2 for the third (the same global batches), and the
    second epoch's merged metrics cover all of it."""
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
    change, *joins = job.state.membership
    assert (change.committed, change.step) == (1, 8)  # the commit after the second epoch's 8th step
    assert 1 <= change.steps_lost <= k
    assert "from the commit after epoch 1 and 8 steps of the next" in out
    # The replacement joins at a later commit of the survivors (every K steps, or an epoch's start): where depends
    # on when the survivors hear of it, and the weights do not (the global batch is kept throughout).
    assert [(j.left, j.joined) for j in joins] == [([], [3])], [j.line for j in joins]
    assert (joins[0].committed, joins[0].step) > (1, 8)

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


def _waits_for_a_silent_peer(rank: int, ports, results) -> None:
    """Rank 1 sums once, then stays silent (a peer cut off: its connections stay open); rank 0's next sum is
    given up by its driver's word a second later."""
    from nbdist.strategies.collective import GenerationBroken, GlooCollective, open_store_listener

    listen_fd = None
    if rank == 0:
        listen_fd, port = open_store_listener("127.0.0.1")
        ports.put(port)
    port = ports.get(timeout=30) if rank == 1 else port
    coll = GlooCollective(rank, 2, "127.0.0.1", port, 120.0, listen_fd=listen_fd)
    buf = np.ones(4, dtype=np.float32)
    coll.allreduce_sum(buf)
    if rank == 1:
        results.put((rank, float(buf[0]), "", 0.0, 0.0))
        time.sleep(60)
        return
    start = time.monotonic()
    coll.broken = lambda: "a member is gone" if time.monotonic() - start > 1.0 else None
    try:
        coll.allreduce_sum(buf)
        why = ""
    except GenerationBroken as exc:
        why = str(exc)
    left = time.monotonic() - start
    coll.close()  # a Gloo call was left running: close ends it rather than wait out the group's 120 s
    results.put((rank, float(buf[0]), why, left, time.monotonic() - start - left))


def test_a_gloo_sum_waiting_for_a_silent_peer_ends_on_the_drivers_word():
    got = run_ranks(_waits_for_a_silent_peer)
    first, why, left, closing = got[0]
    assert first == 2.0 and got[1][0] == 2.0  # the first sum was a real one
    assert why == "a member is gone"
    assert 1.0 <= left < 2.5 and closing < 2.0
