"""The Spark backend on local[2]: DataFrame training, numpy on Spark, a killed worker."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from spark_helpers import (accuracy, digits, digits_frame, wait_until_no_workers, need_spark, small_model,
                           spark_session)

need_spark()

import nbdist  # noqa: E402
from nbdist.api import prepare  # noqa: E402
from nbdist.config import TrainConfig  # noqa: E402
from nbdist.errors import NbdistError, TrainingFailed  # noqa: E402

EPOCHS = 30
# Averaging 2 workers that each take batches of 32 approximates one machine taking batches of 64
# (exact for K=1 and SGD): that is the single-machine run with the same settings.
LOCAL_BATCH = 64


@pytest.fixture(scope="module")
def spark():
    session = spark_session("local[2]")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def data():
    return digits()


@pytest.fixture(scope="module")
def local_accuracy(data):
    Xtr, Xte, ytr, yte = data
    model = small_model()
    model.fit(Xtr, ytr, epochs=EPOCHS, batch_size=LOCAL_BATCH, verbose=0)
    return accuracy(model, Xte, yte)


def test_dataframe_training_matches_local_fit(spark, data, local_accuracy):
    Xtr, Xte, ytr, yte = data
    df = digits_frame(spark, Xtr, ytr)
    model = small_model()
    job = nbdist.train(model, df, features="pixels", label="digit", epochs=EPOCHS, batch_size=32, workers=2,
                       seed=0)  # backend auto: the active SparkContext
    assert job.status == "done" and job.state.backend == "spark"
    assert len(job.history["loss"]) == EPOCHS
    assert sum(w.samples for w in job.state.workers) == len(Xtr)
    got = accuracy(model, Xte, yte)
    assert abs(got - local_accuracy) <= 0.01, (got, local_accuracy)
    assert not wait_until_no_workers(job)


def test_numpy_data_and_rdd_train_on_spark(spark, data):
    Xtr, Xte, ytr, yte = data
    model = small_model()
    job = nbdist.train(model, Xtr, ytr, epochs=2, workers=2, backend="spark")
    assert job.status == "done" and job.state.backend == "spark"
    rdd = spark.sparkContext.parallelize(list(zip(Xtr.tolist(), ytr.tolist())), 3)  # repartitioned to 2
    job = nbdist.train(model, rdd, epochs=2, workers=2, backend="spark")
    assert job.status == "done"
    assert sorted(w.samples for w in job.state.workers) == sorted([len(Xtr) // 2, len(Xtr) - len(Xtr) // 2]) \
        or sum(w.samples for w in job.state.workers) == len(Xtr)
    assert accuracy(model, Xte, yte) > 0.5  # four epochs in all: learning, not chance (0.1)


def test_bad_columns_are_one_sentence(spark, data):
    Xtr, _, ytr, _ = data
    df = digits_frame(spark, Xtr[:20], ytr[:20])
    model = small_model()
    with pytest.raises(NbdistError, match="no column 'pixel'"):
        nbdist.train(model, df, features="pixel", label="digit")
    with pytest.raises(NbdistError, match="--features"):
        nbdist.train(model, df)
    with pytest.raises(NbdistError, match="needs 3 Spark task slots|3 workers need 3 Spark task slots"):
        nbdist.train(model, df, features="pixels", label="digit", workers=3)


def test_killed_worker_fails_fast_and_leaves_nothing(spark, data):
    Xtr, _, ytr, _ = data
    df = digits_frame(spark, Xtr, ytr)
    model = small_model()
    before = model.get_weights()
    config = TrainConfig(epochs=500, batch_size=8, workers=2, backend="spark", ui="none")
    job = prepare(model, config, df, None, None, features=["pixels"], label="digit").start()
    deadline = time.monotonic() + 240
    while job.state.epochs_done < 1:
        assert time.monotonic() < deadline, "training did not start"
        job.pump(0.2)
    victim = next(w for w in job._handles if w.rank == 1)
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(TrainingFailed) as info:
        job.wait(timeout=60)
    elapsed = time.monotonic() - killed_at
    assert elapsed < 15, elapsed
    assert "worker 1" in str(info.value) and "SIGKILL" in str(info.value)
    assert job.status == "failed"
    # Nothing hangs and no worker process survives its task.
    assert not wait_until_no_workers(job)
    # Spark is still usable afterwards: the job group was ended, not the context.
    assert spark.sparkContext.parallelize(range(10), 2).sum() == 45
    assert model.get_weights()[0].shape == before[0].shape
