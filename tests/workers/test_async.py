"""--strategy async (issue 38): a worker 3x slower slows only its own contribution. Real workers, digits.

The slowdown is real: the notebook's PyDataset sleeps in ``__getitem__``, three times longer in the
first worker process that reads from it (claimed through a file) than in the other.
"""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

def _slow_cell() -> str:
    """The notebook's slowed PyDataset, as benchmark row P12 defines it (benchmarks/async_slow.py)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "async_slow.py"
    spec = importlib.util.spec_from_file_location("async_slow", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SLOW


FIT_CELL = """
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(LR), "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(SlowBatches(Xa, ya, 64, PAUSE, CLAIM), epochs=EPOCHS, validation_data=(Xt, yt), verbose=0)
"""


def _run(ip, strategy: str, claim: str | None) -> tuple[float, float, object]:
    ip.user_ns["CLAIM"] = claim
    ip.run_cell_magic("dist_train", f"--workers 2 --strategy {strategy} --ui none", FIT_CELL)
    job = ip.user_ns["history_job"]
    assert job.status == "done", job.error
    _, accuracy = ip.user_ns["model"].evaluate(ip.user_ns["Xt"], ip.user_ns["yt"], verbose=0)
    return sum(job.state.epoch_seconds), accuracy, job


@pytest.mark.full("async's speed beside a slow worker is benchmark row P12's; async training: this module's "
                  "other tests")
def test_async_is_not_held_back_by_a_slow_worker_and_matches_allreduce(ip, digits_split, tmp_path):
    x_train, x_test, y_train, y_test = digits_split
    ip.run_cell(_slow_cell())
    ip.user_ns.update(Xa=x_train, ya=y_train, Xt=x_test, yt=y_test, PAUSE=0.06, EPOCHS=8, LR=0.01)
    seconds, accuracy = {}, {}
    for strategy in ("allreduce", "async"):  # both with one worker slowed (benchmark row P12 times both unslowed)
        claim = str(tmp_path / f"{strategy}.pid")
        seconds[strategy], accuracy[strategy], job = _run(ip, strategy, claim)
        assert os.path.exists(claim)  # a worker was slowed
        if strategy == "async":
            pushed = {r: job.reports[r]["async_pushed"] for r in job.reports}
            assert all(n > 0 for n in pushed.values()), pushed
    print("seconds", seconds, "accuracy", accuracy)
    # Bounds that hold on a loaded CI machine and still fail a synchronous or unsound async (a run held to the
    # slow worker's pace is 1.0; Elephas-style unscaled deltas lose tens of points). The goals themselves
    # (<= 0.6 of allreduce's time, accuracy within 1 point) are benchmark row P12's: measured 0.59 and 0.9656
    # vs 0.9667 once; here 0.565 in one run, and the 1-point check failed 1 run in 5 at 10 epochs (450 test rows:
    # one point is about their noise).
    assert seconds["async"] <= 0.7 * seconds["allreduce"], seconds
    assert abs(accuracy["async"] - accuracy["allreduce"]) <= 0.025, accuracy


def _async_job(ip, digits, listener, epochs: int = 200):
    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    from ..conftest import mlp

    ip.run_cell(_slow_cell())
    x, y = digits
    model = mlp(seed=0)
    data = ip.user_ns["SlowBatches"](x[:600], y[:600], 32, 0.0)
    job = prepare(model, TrainConfig(epochs=epochs, workers=2, strategy="async", ui="none"), data, None, None,
                  listeners=[listener])
    return model, job


def test_a_killed_async_worker_fails_the_run_naming_it_and_leaves_the_model(ip, digits):
    import signal
    import time

    import numpy as np

    from nbdist.errors import TrainingFailed

    from ..conftest import wait_no_workers

    killed: dict = {}

    def kill_after_first_epoch(kind, state, payload):
        if kind == "epoch" and not killed:
            killed["pid"], killed["at"] = state.workers[1].pid, time.monotonic()
            os.kill(state.workers[1].pid, signal.SIGKILL)

    model, job = _async_job(ip, digits, kill_after_first_epoch)
    before = [w.copy() for w in model.get_weights()]
    job.start()
    with pytest.raises(TrainingFailed) as info:
        job.wait(timeout=120)
    assert time.monotonic() - killed["at"] < 10
    assert f"worker 1 (pid {killed['pid']})" in str(info.value) and "SIGKILL" in str(info.value)
    assert "left as it was before the run" in str(info.value)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert not wait_no_workers(5)


def test_an_interrupt_stops_every_async_worker_and_keeps_the_last_epochs_shared_weights(ip, digits):
    import signal
    import time

    import numpy as np

    from ..conftest import wait_no_workers

    seen: dict = {}

    def interrupt_after_two_epochs(kind, state, payload):
        if kind == "epoch" and state.epochs_done == 2 and not seen:
            seen["at"] = time.monotonic()
            seen["shared"] = [w.copy() for w in job._async.full_weights()]
            seen["epoch"] = job._async.completed_epoch
            os.kill(os.getpid(), signal.SIGINT)  # what the kernel's interrupt button sends

    model, job = _async_job(ip, digits, interrupt_after_two_epochs)
    job.start()
    try:
        job.wait(timeout=120)
    except KeyboardInterrupt:
        pass
    else:  # say what happened instead (seen once under load in CI: the run ended, no interrupt raised)
        pytest.fail(f"no interrupt reached the wait: status {job.status}, error {job.error!r}, epochs "
                    f"{job.state.epochs_done}, seen {sorted(seen)}, worker states "
                    f"{[(w.rank, w.state, w.error) for w in job.state.workers]}")
    assert not wait_no_workers(5)
    assert time.monotonic() - seen["at"] < 5
    assert job.status == "stopped"
    # The model holds the shared weights of the last epoch every batch of which was applied.
    assert job.weights_epoch is not None and job.weights_epoch >= seen["epoch"] >= 1
    assert job._async.shared.version > 0 and job._async.shared.refused == 0
    if job.weights_epoch == seen["epoch"]:
        assert all(np.array_equal(a, b) for a, b in zip(seen["shared"], model.get_weights()))


def test_the_notebooks_callbacks_run_at_async_epoch_ends_and_stop_every_worker(ip, digits):
    """EarlyStopping in the cell's model.fit sees merged logs and stops both workers after its patience;
    a callback reading the model sees the shared weights of each epoch."""
    x, y = digits
    ip.run_cell(_slow_cell())
    ip.user_ns.update(Xa=x[:600], ya=y[:600], Xt=x[600:800], yt=y[600:800], PAUSE=0.0, CLAIM=None, LR=0.01)
    cell = FIT_CELL.replace("epochs=EPOCHS,", "epochs=30, callbacks=[keras.callbacks.EarlyStopping('loss', "
                            "min_delta=100, patience=1), keras.callbacks.LambdaCallback(on_epoch_end=lambda e, logs: "
                            "seen.append(float(model.get_weights()[0].sum())))],")
    ip.run_cell("seen = []")
    ip.run_cell_magic("dist_train", "--workers 2 --strategy async --ui none", cell)
    job = ip.user_ns["history_job"]
    assert job.status == "done", job.error
    assert len(job.history["loss"]) == 2 and "val_accuracy" in job.history
    seen = ip.user_ns["seen"]
    assert len(seen) == 2 and seen[0] != seen[1]
    assert seen[-1] == pytest.approx(float(ip.user_ns["model"].get_weights()[0].sum()))


ARRAY_CELL = """
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(XA, ya, batch_size=32, epochs=3, validation_data=(Xt, yt), verbose=0, **FIT)
"""


@pytest.mark.parametrize("road", ["file", "wire"])
def test_async_trains_on_arrays_dealt_by_batch_index(ip, digits_split, tmp_path, road, monkeypatch):
    """In-memory arrays feed async: every worker holds them whole (a local worker maps the notebook's .npy;
    with class weights they cross the wire), the driver deals batch indices. The notebook's model ends on
    the shared weights the workers validated last (its accuracy is the last merged val_accuracy)."""
    import numpy as np

    x_train, x_test, y_train, y_test = digits_split
    if road == "file":
        np.save(tmp_path / "x.npy", x_train)
        xa, fit = np.load(tmp_path / "x.npy", mmap_mode="r"), {}
    else:
        # Keras' validation_freq: validated after the third epoch only.
        xa, fit = x_train, {"class_weight": {c: 1.0 + (c == 3) for c in range(10)}, "validation_freq": 3}
    from nbdist.driver.training import TrainingJob

    sent = {}  # the jobs as the workers got them (a finished run keeps no data to make them again)
    made = TrainingJob._job_message
    monkeypatch.setattr(TrainingJob, "_job_message", lambda self, rank: sent.setdefault(rank, made(self, rank)))
    ip.run_cell("import keras")
    ip.user_ns.update(XA=xa, ya=y_train, Xt=x_test, yt=y_test, FIT=fit)
    ip.run_cell_magic("dist_train", "--workers 2 --strategy async --ui none", ARRAY_CELL)
    job = ip.user_ns["history_job"]
    assert job.status == "done", job.error
    message = sent[1]
    assert message.data_source == road and (message.x is None) == (road == "file")
    if road == "wire":
        assert len(message.x) == len(x_train) and message.sample_weight[y_train == 3].min() == 2.0
    pushed = {r: job.reports[r]["async_pushed"] for r in job.reports}
    assert all(n > 0 for n in pushed.values()), pushed
    # 1347 rows in batches of 16 (each worker's share of the global 32): 85 per epoch. A block may be refused
    # as too stale (the first, while the other worker compiles its step): its rows are not in the shared model.
    assert job._async.batches == 85 and 0 < job._async.shared.samples <= 3 * len(x_train)
    assert len(job.history["val_accuracy"]) == (3 if road == "file" else 1) and job.history["val_accuracy"][-1] > 0.85
    _, accuracy = ip.user_ns["model"].evaluate(x_test, y_test, verbose=0)
    assert accuracy == pytest.approx(job.history["val_accuracy"][-1], abs=1e-6)
