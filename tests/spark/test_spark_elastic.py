"""Elastic runs on Spark classic (issue 48, docs/elastic.md): each worker a Spark job of one task.

One run asks for 2:4 workers on local[3]: it starts with the 3 that have a task slot. In its second epoch a
worker SIGKILLs its Spark task's Python process (the worker goes with it), so the task is lost and its job
fails, as when its executor dies. The other two tasks train on (a barrier stage would have been aborted with
them). The fourth worker's job, waiting for a slot since the launch, takes the lost task's and joins at the
survivors' next commit; the run ends with 3 workers and weights equal to the fault-free runs of the same
membership schedule on the local backend (3 workers for an epoch, 2 from that state, then 3: as
tests/workers/test_elastic.py's reference). A --max-restarts relaunch asks only for the free task slots; a
DataFrame is refused in one sentence; `make test-full` kills an executor's JVM in a local-cluster.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from ..spark_helpers import need_spark, spark_session

need_spark()

from nbdist.api import prepare  # noqa: E402
from nbdist.config import TrainConfig  # noqa: E402

from ..conftest import wait_no_workers  # noqa: E402
from ..workers.test_elastic import BATCH, DieOnce, _model  # noqa: E402

EPOCHS = 3


@pytest.fixture(scope="module")
def spark():
    session = spark_session("local[3]")
    yield session
    session.stop()


def test_a_killed_worker_leaves_the_other_tasks_training(spark, digits, capsys, tmp_path):
    x, y = digits
    common = dict(shuffle=False, seed=7)
    steps_per_epoch = -(-len(x) // 3 // BATCH)
    marker = str(tmp_path / "died")
    model = _model([DieOnce.layer(marker, steps_per_epoch + 6, parent=True)])  # in the 6th step of the second epoch
    # A global batch of 4 x 24 = 96 rows: 32 + 32 + 32 on the 3 that start, 48 + 48 once 2 are left.
    run: dict = {}
    job = run["job"] = prepare(model, TrainConfig(epochs=EPOCHS, workers="2:4", batch_size=3 * BATCH // 4,
                                                  backend="spark", ui="text", **common), x, y, None,
                               listeners=[_until_worker_3_connects(run)])
    job.start()
    history = job.wait(timeout=300)
    out = capsys.readouterr().out

    assert job.status == "done" and os.path.exists(marker)
    assert [len(v) for v in history.values()] == [EPOCHS] * len(history)  # one per epoch, none twice
    first, change, joined = job.state.membership
    assert first.left == [3] and first.workers == [0, 1, 2] and not first.started
    assert ("worker 3 did not start (found no free Spark task slot (3 were free; it joins when it gets one)); "
            "training with 3 workers") in out
    (gone,) = change.left
    assert "lost with its Spark task" in change.why and change.workers == [r for r in range(3) if r != gone]
    # The commit at the second epoch's start; its worker dies in the step its task dies in (DieOnce).
    assert change.committed == 1 and 5 <= change.steps_lost < steps_per_epoch and change.joined == []
    # Worker 3's job waited for a slot since the launch: it took the lost task's, and joined at the survivors'
    # next commit (the replacement's job, behind it, waited for a slot until the run ended).
    assert (joined.left, joined.joined, joined.workers, joined.committed) == ([], [3], [*change.workers, 3], 2)
    assert "worker 3 joined at the commit after epoch 2; training with 3 workers" in out
    assert job.state.backend == "spark" and job.state.world_size == 3
    assert "elastic: goes on while 2 are left" in out.splitlines()[0]
    assert sorted(job.reports) == joined.workers  # the survivors' tasks and the joiner's trained on to the end
    backend = job._backend
    assert backend.workers[gone].lost and "lost with its Spark task" in out  # its job failed, not the others'
    assert not any(backend.workers[r].lost or backend.workers[r].spark_error for r in joined.workers)
    assert len(backend.workers) == 5 and backend.workers[4].pid is None  # the replacement got no slot
    assert not wait_no_workers(5)

    # The same membership schedule without a fault, on local workers: 3 workers for an epoch, 2 from that state
    # for the second, 3 for the third, with the launch's global batch.
    reference = _model([DieOnce.layer(marker, 1)])  # the marker is there: nobody dies
    for workers, batch in ((3, BATCH), (2, 3 * BATCH // 2), (3, BATCH)):
        run = prepare(reference, TrainConfig(epochs=1, workers=workers, batch_size=batch, backend="local",
                                             ui="none", **common), x, y, None)
        run.start()
        run.wait(timeout=300)
    for got, want in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _until_worker_3_connects(run: dict):
    """Holds the driver at the loss's regroup (before the survivors get their jobs) until worker 3, whose job
    takes the lost task's slot, has connected: so it joins at the survivors' next commit, not a later one."""

    def listener(kind, state, payload):
        if kind == "membership" and payload.left and payload.generation > 0:
            deadline = time.monotonic() + 120
            while 3 not in run["job"]._coordinator.connected() and time.monotonic() < deadline:
                time.sleep(0.2)

    return listener


@pytest.mark.full("a lost Spark task's worker replaced by a new job on a free slot: "
                  "test_a_killed_worker_leaves_the_other_tasks_training")
def test_a_relaunch_asks_only_for_the_free_task_slots(spark, digits, capsys):
    """Issue 48's point 5: --max-restarts relaunches on the task slots that are free, not the run's world.
    A worker of a 3-worker run is killed after its first epoch while another job waits for a slot; that job
    takes the slot the killed worker's task frees, so the relaunch gets 2 workers and finishes."""
    x, y = digits
    sc = spark.sparkContext
    blocker = threading.Thread(target=_hold_a_slot, args=(sc,), daemon=True)

    def kill_after_first_epoch(kind, state, payload):
        if kind == "epoch" and state.restarts == 0 and not blocker.is_alive():
            blocker.start()  # waits for a slot: all 3 are the run's
            os.kill(state.workers[2].pid, signal.SIGKILL)

    try:
        job = prepare(_model(), TrainConfig(epochs=2, workers=3, batch_size=BATCH, max_restarts=1, backend="spark",
                                            ui="text"), x, y, None, listeners=[kill_after_first_epoch])
        job.start()
        history = job.wait(timeout=300)
    finally:
        sc.cancelJobGroup("nbdist-test-blocker")
    out = capsys.readouterr().out
    assert job.status == "done" and job.state.restarts == 1 and len(history["loss"]) == 2
    assert job.state.world_size == 2 and len(job._handles) == 2 and sorted(job.reports) == [0, 1]
    assert "with 2 workers instead of 3: the spark backend has room for 2 now" in out
    assert not wait_no_workers(5)


def _hold_a_slot(sc) -> None:
    sc.setJobGroup("nbdist-test-blocker", "holds a task slot", interruptOnCancel=True)
    try:
        sc.parallelize([0], 1).foreach(lambda _: __import__("time").sleep(120))
    except Exception:
        pass  # cancelled


def test_an_elastic_run_refuses_a_dataframe_in_one_sentence(spark, digits):
    """A survivor cannot read a lost task's partition: elastic runs on Spark take arrays (docs/elastic.md)."""
    from nbdist.errors import NbdistError

    x, y = digits
    df = spark.createDataFrame([(row.tolist(), int(label)) for row, label in zip(x[:64], y[:64])], ["pixels", "digit"])
    job = prepare(_model(), TrainConfig(epochs=1, workers="2:3", backend="spark", ui="none"), df, None, None,
                  features="pixels", label="digit")
    with pytest.raises(NbdistError, match=r"df\.toPandas\(\)") as info:
        job.start()
    assert "\n" not in str(info.value) and "a single number" in str(info.value)


@pytest.fixture
def executors(spark):
    """A local-cluster of 3 executors of one core each (executor JVMs of their own), instead of local[3]."""
    import pyspark

    spark.stop()
    os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))  # where executors are started from
    session = spark_session("local-cluster[3,1,1024]", **{"spark.executor.memory": "1g"})
    deadline = time.monotonic() + 120
    while session.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 4:  # the driver and 3 executors
        assert time.monotonic() < deadline, "the local-cluster's executors did not register"
        time.sleep(0.5)
    yield session
    session.stop()


@pytest.mark.full("a lost task: test_a_killed_worker_leaves_the_other_tasks_training")
def test_a_lost_executor_costs_its_worker_not_the_run(executors, digits, capsys):
    """An executor's JVM SIGKILLed after the first epoch: its worker goes with it, the others train on."""
    import psutil

    x, y = digits
    killed: dict = {}

    def kill_executor(kind, state, payload):
        if kind == "epoch" and not killed:
            for process in psutil.Process(state.workers[1].pid).parents():
                if "CoarseGrainedExecutorBackend" in " ".join(process.cmdline()):
                    killed["jvm"] = process.pid
                    os.kill(process.pid, signal.SIGKILL)
                    return

    job = prepare(_model(), TrainConfig(epochs=3, workers="2:3", batch_size=BATCH, backend="spark", ui="text"),
                  x, y, None, listeners=[kill_executor])
    job.start()
    history = job.wait(timeout=300)
    out = capsys.readouterr().out
    assert killed and job.status == "done" and len(history["loss"]) == 3
    change, *joins = job.state.membership
    assert change.left == [1] and change.workers == [0, 2] and "lost with its Spark task" in change.why
    # Its replacement's job waits for a slot: the local-cluster's master starts a new executor, and the
    # replacement joins if it connects before the run ends.
    assert all((j.left, j.joined) == ([], [3]) for j in joins) and len(joins) <= 1
    assert "worker 1 left (was lost with its Spark task" in out and job.state.world_size == 2 + len(joins)
    assert not wait_no_workers(5)

