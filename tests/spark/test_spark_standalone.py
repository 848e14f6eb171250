"""The Spark backend on a real standalone cluster: a master and one worker on 127.0.0.1."""
from __future__ import annotations

import time

import pytest

from ..spark_helpers import (
    accuracy,
    digits,
    digits_frame,
    need_spark,
    small_model,
    spark_session,
    wait_until_no_workers,
    wait_warm_ready,
    warm_socket_workers,
)

need_spark()

import nbdist  # noqa: E402

EPOCHS = 30
LOCAL_BATCH = 64  # 2 workers x 32: see test_spark_local.py


@pytest.fixture(scope="module")
def spark(standalone):
    session = spark_session(standalone, **{"spark.executor.memory": "1g", "spark.cores.max": "2"})
    # Wait until the worker's executor has registered, so both barrier slots exist.
    deadline = time.monotonic() + 120
    while session.sparkContext.defaultParallelism < 2 or \
            session.sparkContext._jsc.sc().getExecutorMemoryStatus().size() < 2:
        assert time.monotonic() < deadline, "no executor registered with the standalone master"
        time.sleep(1)
    yield session
    session.stop()


@pytest.mark.full
def test_dataframe_training_on_standalone_cluster(spark):
    """Averaging on a DataFrame as test_spark_local.py's local[2] run, on the standalone cluster.

    Marked full: CI covers each of its parts elsewhere. The accuracy against one machine with the same
    settings is test_spark_local.py's test_dataframe_training_matches_local_fit; a DataFrame trained by
    a standalone cluster's executors (cold workers first, then warm) is the next test's; cold workers on a
    standalone cluster that leave nothing are test_multihost.py's test_trains_across_two_hosts[allreduce].
    """
    Xtr, Xte, ytr, yte = digits()
    assert spark.sparkContext.master.startswith("spark://127.0.0.1")
    local = small_model()
    local.fit(Xtr, ytr, epochs=EPOCHS, batch_size=LOCAL_BATCH, verbose=0)
    model = small_model()
    job = nbdist.train(model, digits_frame(spark, Xtr, ytr), features="pixels", label="digit",
                       epochs=EPOCHS, batch_size=32, workers=2, seed=0, strategy="averaging")
    assert job.status == "done" and job.state.backend == "spark"
    got, want = accuracy(model, Xte, yte), accuracy(local, Xte, yte)
    assert got >= want - 0.01, (got, want)  # not more than 1 point below one machine (see test_spark_local)
    assert not wait_until_no_workers(job)


@pytest.mark.full("the claim of an executor's warm workers: test_spark_warm.py's local[2] run; a standalone "
                  "cluster's executors training: test_multihost.py's test_trains_across_two_hosts[allreduce]")
def test_a_standalone_executor_keeps_warm_workers_for_the_next_run(spark, warm_executors):
    Xtr, Xte, ytr, yte = digits()
    df = digits_frame(spark, Xtr, ytr)
    nbdist.train(small_model(), df, features="pixels", label="digit", epochs=1, workers=2, ui="none")
    left = warm_socket_workers()  # left by the executor's tasks, in the executor's own directory
    assert len(left) == 2 and len({s.parent for s in left.values()}) == 1, left
    wait_warm_ready(next(iter(left.values())).parent, 2)
    model = small_model()
    job = nbdist.train(model, df, features="pixels", label="digit", epochs=8, workers=2, ui="none")
    assert [w.warm for w in job._backend.workers] == [True, True]
    assert {w.pid for w in job._backend.workers} == set(left)
    assert accuracy(model, Xte, yte) > 0.8
