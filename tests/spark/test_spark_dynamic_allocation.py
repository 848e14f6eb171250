"""Spark under dynamic allocation (EMR's and Dataproc's default) on a real standalone cluster.

Spark refuses barrier stages there, so the workers' stage is an ordinary one: the session starts with no
executor (minExecutors 0) and Spark adds them for the stage's waiting tasks. A DataFrame and arrays train, on a
classic session and over Spark Connect; a worker whose task dies is named and relaunched under --max-restarts; an
application that can get no executor, or a task that gets no slot, is one sentence within the wait, not Spark's
wait forever.
"""
from __future__ import annotations

import os
import time

import pytest

from ..spark_helpers import (
    accuracy,
    connect_server,
    digits,
    digits_frame,
    need_spark,
    small_model,
    spark_session,
    wait_until_no_workers,
)

need_spark()

import nbdist  # noqa: E402
from nbdist.api import prepare  # noqa: E402
from nbdist.config import TrainConfig  # noqa: E402
from nbdist.errors import NbdistError, TrainingFailed  # noqa: E402
from nbdist.spark import cluster as spark_cluster  # noqa: E402

from ..conftest import wait_no_workers  # noqa: E402
from ..workers.test_elastic import DieOnce, _model  # noqa: E402

EPOCHS = 10
DYNAMIC = {"spark.dynamicAllocation.enabled": "true", "spark.dynamicAllocation.shuffleTracking.enabled": "true",
           "spark.dynamicAllocation.minExecutors": "0", "spark.dynamicAllocation.initialExecutors": "0",
           "spark.executor.cores": "1", "spark.executor.memory": "768m"}


@pytest.fixture(scope="module")
def spark(standalone):
    session = spark_session(standalone, **DYNAMIC)
    yield session
    session.stop()


def test_a_dataframe_and_arrays_train_on_the_executors_spark_adds(spark):
    Xtr, Xte, ytr, yte = digits()
    sc = spark.sparkContext
    assert spark_cluster.registered(sc).count == 0  # none until tasks wait
    local = small_model()
    local.fit(Xtr, ytr, epochs=EPOCHS, batch_size=64, verbose=0)
    model = small_model()
    job = nbdist.train(model, digits_frame(spark, Xtr, ytr), features="pixels", label="digit", epochs=EPOCHS,
                       batch_size=32, workers=2, seed=0, ui="none")
    assert job.status == "done" and job.state.backend == "spark" and not job._backend.barrier
    assert all(w.pid for w in job._backend.workers) and spark_cluster.registered(sc).count == 2
    got, want = accuracy(model, Xte, yte), accuracy(local, Xte, yte)
    assert got >= want - 0.02, (got, want)  # allreduce: the local step on the global batch of 64
    assert not wait_until_no_workers(job)

    model = small_model()
    job = nbdist.train(model, Xtr, ytr, backend="spark", epochs=EPOCHS, batch_size=32, workers=2, seed=0, ui="none")
    assert job.status == "done" and accuracy(model, Xte, yte) >= want - 0.02
    assert not wait_until_no_workers(job)


def test_a_worker_whose_task_dies_is_named_and_relaunched(spark, tmp_path, capsys):
    Xtr, _, ytr, _ = digits()
    marker = str(tmp_path / "died")
    model = _model([DieOnce.layer(marker, 30, parent=True)])  # in the second epoch, with its task's Python
    job = prepare(model, TrainConfig(epochs=3, workers=2, batch_size=32, max_restarts=1, backend="spark",
                                     ui="text"), Xtr, ytr, None)
    job.start()
    history = job.wait(timeout=300)
    out = capsys.readouterr().out
    assert os.path.exists(marker) and job.status == "done" and job.state.restarts == 1
    assert len(history["loss"]) == 3
    assert "was lost with its Spark task" in out, out
    assert not wait_no_workers(5)


def test_no_executor_or_no_slot_is_one_sentence_within_the_wait(standalone, spark):
    """Executors of 8 GiB on a worker of 2: Spark can never start one, and would wait forever."""
    spark.stop()  # else the builder hands back this module's session, whatever the settings
    session = spark_session(standalone, **{**DYNAMIC, "spark.executor.memory": "8g"})
    try:
        Xtr, _, ytr, _ = digits()
        start = time.monotonic()
        with pytest.raises(NbdistError) as info:  # the label check's one-row job, cancelled after the wait
            nbdist.train(small_model(), digits_frame(session, Xtr, ytr), features="pixels", label="digit",
                         epochs=1, workers=2, ui="none", executor_wait=3)
        assert str(info.value).startswith("no Spark executor registered") and "\n" not in str(info.value)
        assert time.monotonic() - start < 60

        job = prepare(small_model(), TrainConfig(epochs=1, workers=2, backend="spark", ui="none",
                                                 startup_timeout=10), Xtr, ytr, None)
        job.start()
        with pytest.raises(TrainingFailed, match=r"worker \d \(Spark task \d; its task got no slot: under dynamic "
                                                 r"allocation .* did not connect within 10 s"):
            job.wait(timeout=120)
    finally:
        session.stop()

    session = spark_session(standalone, **{**DYNAMIC, "spark.speculation": "true"})
    try:  # a copy of a slow worker's task would start no worker, and Spark would kill the one that has it
        with pytest.raises(NbdistError, match="spark.speculation=false"):
            nbdist.train(small_model(), Xtr, ytr, backend="spark", epochs=1, workers=2, ui="none")
    finally:
        session.stop()


def test_a_connect_client_trains_on_the_executors_spark_adds(standalone, spark, tmp_path_factory):
    """The Connect server's session has dynamic allocation; the client reads it from the server's settings."""
    import pandas as pd

    spark.stop()
    Xtr, Xte, ytr, yte = digits()
    with connect_server(tmp_path_factory, standalone, **DYNAMIC) as (session, _):
        df = session.createDataFrame(pd.DataFrame({"pixels": Xtr.astype(float).tolist(), "digit": ytr.astype(int)}))
        model = small_model()
        job = nbdist.train(model, df, features="pixels", label="digit", epochs=EPOCHS, batch_size=32, workers=2,
                           seed=0, ui="none")
        assert job.status == "done" and not job._backend.barrier and job._backend.connect
        assert accuracy(model, Xte, yte) > 0.85
    assert not wait_no_workers(5)
