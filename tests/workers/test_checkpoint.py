"""Checkpoint files, their atomicity, the resume checks and restart bookkeeping: no workers here."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from nbdist.config import TrainConfig
from nbdist.driver import checkpoint
from nbdist.driver.checkpoint import Checkpoint
from nbdist.driver.keeper import CheckpointKeeper
from nbdist.driver.state import RunState
from nbdist.errors import NbdistError
from nbdist.ui.text import TextRenderer
from nbdist.wire.reports import Epoch

from ..conftest import mlp


def make_ckpt(epoch: int, seed: int = 0) -> Checkpoint:
    rng = np.random.default_rng(seed)
    return Checkpoint(epoch=epoch, weights=[rng.normal(size=(64, 32)).astype("float32"),
                                            rng.normal(size=32).astype("float32")],
                      optimizer_weights=[rng.normal(size=(64, 32)).astype("float32")], iterations=epoch * 29,
                      history={"loss": [1.0 / (e + 1) for e in range(epoch)]}, weight_names=["k", "b"],
                      optimizer="Adam")


def assert_same(a: Checkpoint, b: Checkpoint) -> None:
    assert a.epoch == b.epoch and a.iterations == b.iterations and a.history == b.history
    assert all(np.array_equal(x, y) for x, y in zip(a.weights, b.weights)) and len(a.weights) == len(b.weights)
    assert all(np.array_equal(x, y) for x, y in zip(a.optimizer_weights, b.optimizer_weights))


def test_round_trip_keeps_only_the_last_checkpoint(tmp_path):
    checkpoint.save(tmp_path, make_ckpt(1, seed=1))
    second = make_ckpt(2, seed=2)
    checkpoint.save(tmp_path, second)
    assert_same(checkpoint.load(tmp_path), second)
    assert os.listdir(tmp_path) == [checkpoint.FILENAME]
    # No pickle inside: numpy reads every member with pickles refused.
    with np.load(checkpoint.path_in(tmp_path), allow_pickle=False) as z:
        assert all(z[name].dtype != object for name in z.files)


class FailsMidway:
    """An array whose conversion raises: the writer has already written the arrays before it."""

    def __array__(self, dtype=None, copy=None):
        raise OSError("disk unplugged")


def test_a_write_that_fails_midway_leaves_the_previous_checkpoint(tmp_path):
    first = make_ckpt(3, seed=3)
    checkpoint.save(tmp_path, first)
    broken = make_ckpt(4, seed=4)
    broken.weights.append(FailsMidway())
    with pytest.raises(OSError, match="disk unplugged"):
        checkpoint.save(tmp_path, broken)
    assert_same(checkpoint.load(tmp_path), first)
    assert os.listdir(tmp_path) == [checkpoint.FILENAME]  # the half-written temp file is gone


SLOW_WRITER = textwrap.dedent("""
    import sys, time
    import numpy as np
    from nbdist.driver import checkpoint

    class Slow:
        def __array__(self, dtype=None, copy=None):
            print("midway", flush=True)  # 8 MB of this checkpoint are on disk by now
            time.sleep(120)
            return np.zeros(1, dtype="float32")

    big = np.ones((2048, 1024), dtype="float32")
    checkpoint.save(sys.argv[1], checkpoint.Checkpoint(epoch=9, weights=[big, Slow()], optimizer_weights=[],
                                                       iterations=9, history={}))
""")


def test_a_writer_killed_midway_leaves_the_previous_checkpoint_readable(tmp_path):
    first = make_ckpt(5, seed=5)
    checkpoint.save(tmp_path, first)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", SLOW_WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"midway"
        os.kill(proc.pid, signal.SIGKILL)  # a crash in the middle of the write
    finally:
        proc.kill()
        proc.wait(timeout=10)
    leftovers = [n for n in os.listdir(tmp_path) if n != checkpoint.FILENAME]
    assert len(leftovers) == 1 and os.path.getsize(tmp_path / leftovers[0]) > 1_000_000  # really half-written
    assert_same(checkpoint.load(tmp_path), first)
    checkpoint.save(tmp_path, make_ckpt(6))  # the next write clears what the crash left
    assert os.listdir(tmp_path) == [checkpoint.FILENAME]
    assert checkpoint.load(tmp_path).epoch == 6


def one_sentence(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and message.endswith(".") and len(message) < 300, message
    return message


def test_resume_from_an_empty_directory_says_so(tmp_path, digits):
    x, y = digits
    from nbdist.api import prepare

    job = prepare(mlp(0), TrainConfig(epochs=2, resume=True, checkpoint_dir=str(tmp_path), ui="none"),
                  x, y, None)
    with pytest.raises(NbdistError) as info:
        job.start()
    assert "no checkpoint in" in one_sentence(info) and job.status == "created"


def test_resume_with_a_different_model_is_refused_and_touches_nothing(tmp_path, digits):
    x, y = digits
    writer = mlp(0)
    keeper = CheckpointKeeper.for_run(TrainConfig(epochs=4, checkpoint_dir=str(tmp_path)), writer)
    keeper.save(2, writer.get_weights(), [], 10, {"loss": [2.0, 1.0]}, 2)

    import keras

    other = keras.Sequential([keras.Input((64,)), keras.layers.Dense(48, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    other.compile("adam", "sparse_categorical_crossentropy")
    before = [w.copy() for w in other.get_weights()]
    from nbdist.api import prepare

    job = prepare(other, TrainConfig(epochs=4, resume=True, checkpoint_dir=str(tmp_path), ui="none"), x, y, None)
    with pytest.raises(NbdistError) as info:
        job.start()
    message = one_sentence(info)
    assert "does not match this model" in message and "(64, 32)" in message and "(64, 48)" in message
    assert all(np.array_equal(a, b) for a, b in zip(before, other.get_weights()))

    sgd = mlp(0, optimizer="sgd")
    job = prepare(sgd, TrainConfig(epochs=4, resume=True, checkpoint_dir=str(tmp_path), ui="none"), x, y, None)
    with pytest.raises(NbdistError) as info:
        job.start()
    assert "Adam optimizer state" in one_sentence(info)

    job = prepare(mlp(1), TrainConfig(epochs=2, resume=True, checkpoint_dir=str(tmp_path), ui="none"), x, y, None)
    with pytest.raises(NbdistError) as info:
        job.start()
    assert "raise --epochs above 2" in one_sentence(info)


@pytest.mark.parametrize("options, fragment", [
    ({"resume": True}, "--resume continues"),
    ({"max_restarts": -1}, "--max-restarts"),
    ({"max_restarts": 1.5}, "--max-restarts"),
    ({"checkpoint_dir": ""}, "--checkpoint-dir"),
    ({"checkpoint_dir": 3}, "--checkpoint-dir"),
])
def test_bad_options_get_one_sentence(options, fragment):
    with pytest.raises(NbdistError) as info:
        TrainConfig(**options)
    assert fragment in one_sentence(info)


def test_checkpoint_dir_that_is_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(NbdistError) as info:
        checkpoint.prepare_dir(target)
    assert "is a file" in one_sentence(info)


def test_restart_rewinds_the_run_state_in_place():
    st = RunState(2, epochs=6)
    live = st.history
    for epoch in range(3):
        for rank in range(2):
            st.worker_epoch(rank, Epoch(epoch=epoch, logs={"loss": 1.0 / (epoch + 1)}, samples=10,
                                        val_samples=0, seconds=1.0))
    st.worker_epoch(0, Epoch(epoch=3, logs={"loss": 0.2}, samples=10, val_samples=0, seconds=0.0))  # rank 1 died
    st.restarting(completed=2)
    assert st.status == "restarting" and st.restarts == 1
    assert st.history is live and live == {"loss": [1.0, 0.5]} and st.epochs_done == 2
    assert [w.state for w in st.workers] == ["starting", "starting"]
    st.worker_connected(0, "h", 1)
    assert st.status == "running"
    # Epoch 3 is reported afresh by both new workers, not merged with the dead run's half.
    assert st.worker_epoch(0, Epoch(epoch=2, logs={"loss": 0.3}, samples=10, val_samples=0, seconds=0.0)) is None
    assert st.worker_epoch(1, Epoch(epoch=2, logs={"loss": 0.3}, samples=10, val_samples=0, seconds=0.0)) is not None
    assert live["loss"] == [1.0, 0.5, 0.3]


def test_text_renderer_prints_one_line_per_restart():
    out = io.StringIO()
    render = TextRenderer(out)
    st = RunState(2, epochs=4)
    render("restart", st, "worker 1 (pid 7) was killed by SIGKILL during training; restart 1 of 2, ...")
    render("some-future-kind", st, None)  # unknown kinds are ignored
    assert out.getvalue() == "nbdist: worker 1 (pid 7) was killed by SIGKILL during training; restart 1 of 2, ...\n"


def test_restart_without_a_finished_epoch_starts_over_and_temp_dir_is_removed():
    model = mlp(0)
    keeper = CheckpointKeeper.for_run(TrainConfig(max_restarts=2), model)
    assert keeper.temporary and os.path.isdir(keeper.directory)
    from nbdist.model.spec import spec_from_model

    spec = spec_from_model(model)
    assert keeper.start_point(spec) == (spec, 0)
    assert keeper.can_restart()
    assert keeper.restart_point() == (spec, 0)
    assert "from the start" in keeper.restart_reason("worker 0 failed", 0)
    keeper.save(1, [w * 2 for w in spec.weights], [], 29, {"loss": [0.5]}, 2)
    restarted, epoch = keeper.restart_point()
    assert epoch == 1 and np.array_equal(restarted.weights[0], spec.weights[0] * 2)
    assert not keeper.can_restart()
    keeper.close()
    assert not os.path.exists(keeper.directory)
