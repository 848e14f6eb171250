"""R3 with real workers on digits: crash then --resume, and --max-restarts doing it without the user.

With ``shuffle=False`` a run that resumes from a checkpoint (weights, optimizer slots and
step count restored) must end where an uninterrupted run ends: this is checked exactly,
for both strategies, as well as the issue's "within 1 point of accuracy".
"""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest

import nbdist
from nbdist.api import prepare
from nbdist.config import TrainConfig
from nbdist.driver import checkpoint
from nbdist.errors import TrainingFailed

from ..conftest import mlp, relative_error, wait_no_workers
from .test_failures import FAILING_CELL  # a layer that raises after 20 training steps

EPOCHS = 6
KILL_AFTER = 2  # epochs


def accuracy(model, x, y) -> float:
    return float((model.predict(x, verbose=0).argmax(1) == y).mean())


def options(strategy: str, **more):
    return {"epochs": EPOCHS, "workers": 2, "strategy": strategy, "shuffle": False, "batch_size": 32, "ui": "none",
            **more}


@pytest.fixture(scope="module")
def reference(digits_split):
    """Uninterrupted runs, one per strategy (computed when a test first asks for it)."""
    x, _, y, _ = digits_split
    cache = {}

    def get(strategy: str):
        if strategy not in cache:
            job = nbdist.train(mlp(0), x, y, **options(strategy))
            cache[strategy] = job
        return cache[strategy]

    return get


def killer(after: int, times: int = 1):
    """A listener that kill -9s worker 1 when epoch ``after`` ends (its checkpoint is on disk by then)."""
    killed: list[int] = []

    def listen(kind, state, payload):
        if kind == "epoch" and len(killed) < times and state.initial_epoch + state.epochs_done >= after:
            pid = state.workers[1].pid
            killed.append(pid)
            os.kill(pid, signal.SIGKILL)

    listen.killed = killed
    return listen


@pytest.mark.parametrize("strategy", [pytest.param("averaging", marks=pytest.mark.full(
    "averaging's state restored from a checkpoint: test_max_restarts_recovers_without_the_user; a crash then "
    "--resume: the allreduce case")), "allreduce"])
def test_crash_then_resume_continues_from_the_checkpoint(strategy, reference, digits_split, tmp_path):
    x, xt, y, yt = digits_split
    ref = reference(strategy)
    ckpt_dir = str(tmp_path / "ckpt")

    crashed_model = mlp(0)
    before = [w.copy() for w in crashed_model.get_weights()]
    kill = killer(KILL_AFTER)
    job = prepare(crashed_model, TrainConfig(**options(strategy, checkpoint_dir=ckpt_dir)), x, y, None,
                  listeners=[kill])
    job.start()
    with pytest.raises(TrainingFailed, match="SIGKILL"):
        job.wait(timeout=300)
    assert not wait_no_workers(5)
    assert all(np.array_equal(a, b) for a, b in zip(before, crashed_model.get_weights()))  # untouched

    saved = checkpoint.load(ckpt_dir)
    # Workers may finish one more epoch before the driver sees the kill; never fewer than KILL_AFTER.
    assert KILL_AFTER <= saved.epoch < EPOCHS
    assert saved.history["loss"] == pytest.approx(ref.history["loss"][:saved.epoch], rel=1e-5)
    assert os.listdir(ckpt_dir) == [checkpoint.FILENAME]

    resumed_model = mlp(seed=7)  # a fresh cell: different initial weights, replaced by the checkpoint's
    resumed = nbdist.train(resumed_model, x, y, **options(strategy, checkpoint_dir=ckpt_dir, resume=True))
    assert resumed.status == "done" and resumed.state.initial_epoch == saved.epoch
    assert resumed.state.epochs_done == EPOCHS - saved.epoch  # only the missing epochs ran
    assert len(resumed.history["loss"]) == EPOCHS
    assert resumed.history["loss"][:saved.epoch] == saved.history["loss"]
    # Weights, optimizer slots and Adam's step count all came back: the resumed run ends where
    # the uninterrupted one did.
    assert relative_error(resumed_model.get_weights(), ref.model.get_weights()) < 1e-4
    np.testing.assert_allclose(resumed.history["loss"], ref.history["loss"], rtol=1e-4)
    assert abs(accuracy(resumed_model, xt, yt) - accuracy(ref.model, xt, yt)) <= 0.01
    assert checkpoint.load(ckpt_dir).epoch == EPOCHS
    assert not wait_no_workers(5)


def test_max_restarts_recovers_without_the_user(reference, digits_split, capsys):
    x, xt, y, yt = digits_split
    ref = reference("averaging")
    model = mlp(0)
    kill = killer(KILL_AFTER)
    restarts = []
    job = prepare(model, TrainConfig(**options("averaging", max_restarts=1, ui="text")), x, y, None,
                  listeners=[kill, lambda kind, st, payload: kind == "restart" and restarts.append(payload)])
    job.start()
    live_history = job.history
    job.run_in_background()  # as with --background: the restart happens on the pump thread
    job.wait(timeout=300)
    assert job.status == "done" and job.state.restarts == 1
    assert len(restarts) == 1 and f"(pid {kill.killed[0]}) was killed by SIGKILL" in restarts[0]
    assert "restart 1 of 1, from the checkpoint after epoch" in restarts[0]
    out = capsys.readouterr().out
    assert sum(line.startswith("nbdist: worker 1") and "restart 1 of 1" in line for line in out.splitlines()) == 1
    assert job.history is live_history and len(job.history["loss"]) == EPOCHS
    assert relative_error(model.get_weights(), ref.model.get_weights()) < 1e-4
    assert abs(accuracy(model, xt, yt) - accuracy(ref.model, xt, yt)) <= 0.01
    assert not os.path.exists(job._keeper.directory)  # the temporary checkpoint directory went with the run
    assert not wait_no_workers(5)


def test_after_max_restarts_the_cell_fails_with_the_workers_traceback(ip, capsys):
    result = ip.run_cell(f"%%dist_train --data X,y --epochs 3 --workers 1 --max-restarts 1 --ui text "
                         f"--out h\n{FAILING_CELL}")
    assert not result.success
    assert "injected failure in Boom" in str(result.error_in_exec)
    captured = capsys.readouterr()
    restart_lines = [ln for ln in captured.out.splitlines() if "restart 1 of 1" in ln]
    # 600 samples: 19 steps per epoch, so epoch 1 ends before step 20 fails; the restart resumes after it
    # (with Boom's step counter, a non-trainable weight, restored from the checkpoint) and fails again.
    assert len(restart_lines) == 1 and "from the checkpoint after epoch 1" in restart_lines[0]
    shown = captured.out + captured.err  # the worker's error, shown as IPython shows the cell's exception
    assert "--- raised on worker 0 ---" in shown and "Traceback (most recent call last)" in shown
    assert "injected failure in Boom" in shown
    assert not wait_no_workers(5)
