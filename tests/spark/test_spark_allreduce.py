"""Allreduce on Spark local[2], and a Spark run's job group cancelled on interrupt and on failure."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ..spark_helpers import accuracy, digits_frame, need_spark, small_model

need_spark()

import nbdist  # noqa: E402
from nbdist.api import prepare  # noqa: E402
from nbdist.config import TrainConfig  # noqa: E402
from nbdist.errors import TrainingFailed  # noqa: E402

EPOCHS = 20


def test_allreduce_on_spark_matches_local_fit(spark, data, no_leftover_workers):
    Xtr, Xte, ytr, yte = data
    # Two workers with batch 32 each, gradients averaged every step: one machine with batch 64.
    reference = small_model()
    reference.fit(Xtr, ytr, epochs=EPOCHS, batch_size=64, verbose=0)
    local = accuracy(reference, Xte, yte)
    model = small_model()
    job = nbdist.train(model, digits_frame(spark, Xtr, ytr), features="pixels", label="digit", epochs=EPOCHS,
                       batch_size=32, workers=2, strategy="allreduce", lr_scaling="none", seed=0)
    assert job.status == "done" and job.state.backend == "spark" and job.state.strategy == "allreduce"
    # Spark's tasks run on this machine: the small MLP's gradients are summed in shared memory.
    assert [r["summed_by"] for r in job.reports.values()] == ["shared", "shared"]
    assert len(job.history["loss"]) == EPOCHS and job.history["loss"][-1] < job.history["loss"][0]
    got = accuracy(model, Xte, yte)
    assert abs(got - local) <= 0.01, (got, local)


def _stalled_pairs(sc, X, y, fail_partition: int | None = None):
    """An RDD of (x, y) whose rows stall (or fail) only inside nbdist's barrier stage.

    Counting the partitions (an ordinary stage) runs normally; the barrier tasks then sit
    reading their partition, so they cannot end by themselves and must be cancelled.
    """
    def slow(pair):
        from pyspark import TaskContext
        from pyspark.taskcontext import BarrierTaskContext

        ctx = TaskContext.get()
        if isinstance(ctx, BarrierTaskContext):
            if ctx.partitionId() == fail_partition:
                raise ValueError("boom: this partition cannot be read")
            time.sleep(600)
        return pair

    return sc.parallelize(list(zip(X.tolist(), y.tolist())), 2).map(slow)


def _group_is_idle(sc, group: str, timeout: float = 30.0) -> tuple[bool, list[str]]:
    """Whether every Spark job of ``group`` has ended and no stage is active, within ``timeout``."""
    tracker = sc.statusTracker()
    deadline = time.monotonic() + timeout
    while True:
        ids = tracker.getJobIdsForGroup(group)
        states = [str(tracker.getJobInfo(i).status) for i in ids if tracker.getJobInfo(i) is not None]
        if ids and "RUNNING" not in states and not tracker.getActiveStageIds():
            return True, states
        if time.monotonic() > deadline:
            return False, states
        time.sleep(0.2)


def _wait_for_barrier_tasks(sc, job, timeout: float = 60.0) -> None:
    tracker = sc.statusTracker()
    deadline = time.monotonic() + timeout
    while True:
        job.pump(0.2)
        ids = tracker.getJobIdsForGroup(job._backend.group)
        stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
        if ids and any(s is not None and s.numActiveTasks == 2 for s in stages):
            return
        assert time.monotonic() < deadline, "the barrier tasks did not start"


def test_interrupt_cancels_the_job_group(spark, data, no_leftover_workers):
    Xtr, _, ytr, _ = data
    sc = spark.sparkContext
    model = small_model()
    config = TrainConfig(epochs=1, workers=2, backend="spark", ui="none", startup_timeout=600)
    job = prepare(model, config, _stalled_pairs(sc, Xtr[:200], ytr[:200]), None, None).start()
    group = job._backend.group
    _wait_for_barrier_tasks(sc, job)
    # The kernel's interrupt: SIGINT lands in wait() on the main thread as KeyboardInterrupt.
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        job.wait(timeout=120)
    idle, states = _group_is_idle(sc, group)
    assert idle, f"tasks of {group} still running: {states}"
    assert states == ["FAILED"]  # cancelled, not finished by itself
    assert time.monotonic() - started < 45
    assert job.status == "stopped"
    assert sc.parallelize(range(10), 2).sum() == 45  # the context lives on


def test_failure_cancels_the_job_group(spark, data, no_leftover_workers):
    Xtr, _, ytr, _ = data
    sc = spark.sparkContext
    model = small_model()
    config = TrainConfig(epochs=1, workers=2, backend="spark", ui="none", startup_timeout=600)
    job = prepare(model, config, _stalled_pairs(sc, Xtr[:200], ytr[:200], fail_partition=1), None, None).start()
    group = job._backend.group
    started = time.monotonic()
    with pytest.raises(TrainingFailed) as info:
        job.wait(timeout=120)
    assert "worker 1" in str(info.value)
    assert "boom: this partition cannot be read" in info.value.worker_traceback
    idle, states = _group_is_idle(sc, group)
    assert idle, f"tasks of {group} still running: {states}"
    assert states == ["FAILED"]  # task 0 was still stalled: cancelled
    assert time.monotonic() - started < 60
    assert sc.parallelize(range(10), 2).sum() == 45
