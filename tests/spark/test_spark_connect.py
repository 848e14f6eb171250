"""Spark Connect: a real Connect server (PySpark's own, on loopback) and a notebook holding only a client.

One server for the module (it takes 10-40 s to start here). The tests that leave warm workers
on its executor come last, so the worker counts of the others hold.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import keras
import numpy as np
import pytest

from ..conftest import wait_no_workers
from ..spark_helpers import (
    accuracy,
    connect_server,
    digits,
    need_spark,
    partition_order,
    small_model,
    stop_shared_session,
    wait_until_no_workers,
    wait_warm_ready,
    warm_socket_workers,
)
from ..workers.test_backends import assert_remote_run, run_driver

need_spark()
for _module in ("grpc", "grpc_status", "google.rpc", "zstandard"):  # the `spark` extra's Connect client
    pytest.importorskip(_module)

import nbdist  # noqa: E402
from nbdist.api import prepare  # noqa: E402
from nbdist.config import TrainConfig  # noqa: E402
from nbdist.errors import NbdistError, TrainingFailed  # noqa: E402

EPOCHS = 20
CONNECT_URL: list[str] = []  # the module's server, while it runs


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    """A Spark Connect server (local[2]) on a free loopback port, and a client session to it."""
    stop_shared_session()  # the local[2] session of the modules before: this process is the Connect client only
    with connect_server(tmp_path_factory, "local[2]") as (session, url):
        CONNECT_URL.append(url)  # for notebooks of other backends (their own processes)
        yield session
        CONNECT_URL.clear()


@pytest.fixture(scope="module")
def data():
    return digits()


def _frame(spark, X, y):
    import pandas as pd

    pdf = pd.DataFrame({"pixels": X.astype("float64").tolist(), "digit": y.astype("int64")})
    return spark.createDataFrame(pdf)


@pytest.fixture(scope="module")
def test_frame(spark, data):
    _, Xte, _, yte = data
    return _frame(spark, Xte, yte).repartition(2)


def test_session_is_connect_and_auto_finds_it(spark):
    from nbdist.driver.resolve import resolve_backend
    from nbdist.spark.backend import active_spark_context

    assert type(spark).__module__.startswith("pyspark.sql.connect")
    assert active_spark_context() is None  # no SparkContext in this process
    backend = resolve_backend(TrainConfig(backend="auto"))
    assert backend.name == "spark" and backend.connect and backend.default_workers() == 2


@pytest.mark.full("evaluate's metrics and AUC on a DataFrame: test_spark_inference.py's test_binary_metrics_on_"
                  "dataframe_equal_keras_and_sklearn; a weight column: test_spark_stream.py's test_a_weight_column_"
                  "is_sample_weight_for_training_and_evaluation; evaluation by Connect's workers: test_validation_"
                  "dataframe_streams_over_connect_with_exact_metrics")
def test_evaluate_equals_keras_incl_auc(spark, data, test_frame, no_leftover_workers):
    Xtr, Xte, ytr, yte = data
    keras.utils.set_random_seed(4)
    binary = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                               keras.layers.Dense(1, activation="sigmoid")])
    binary.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
                   metrics=["accuracy", keras.metrics.AUC(name="auc")])
    binary.fit(Xtr, (ytr >= 5).astype("float32"), epochs=2, batch_size=32, verbose=0)
    from pyspark.sql import functions as F

    frame = test_frame.withColumn("big", (F.col("digit") >= 5).cast("double"))
    got = nbdist.evaluate(binary, frame, features="pixels", label="big", workers=2)
    want = binary.evaluate(Xte, (yte >= 5).astype("float32"), batch_size=256, verbose=0, return_dict=True)
    assert got["samples"] == len(Xte)
    for name in ("loss", "accuracy", "auc"):
        assert abs(got[name] - want[name]) < 1e-6, (name, got[name], want[name])
    # A weight column (whole numbers here) is evaluate's sample_weight over Connect too: the loss weighs by it.
    got = nbdist.evaluate(binary, frame.withColumn("w", F.col("digit") + 1), features="pixels", label="big",
                          weight_col="w", workers=2)
    weighted = binary.evaluate(Xte, (yte >= 5).astype("float32"), sample_weight=(yte + 1).astype("float32"),
                               batch_size=256, verbose=0, return_dict=True)
    assert abs(weighted["loss"] - want["loss"]) > 1e-3
    for name in ("loss", "accuracy", "auc"):
        assert abs(got[name] - weighted[name]) < 1e-6, (name, got[name], weighted[name])


@pytest.mark.full("predict on a DataFrame where it lives: test_spark_inference.py's predict test")
def test_predict_equals_model_predict(spark, data, test_frame):
    _, Xte, _, yte = data
    model = small_model(1)
    out = nbdist.predict(model, test_frame, features="pixels")  # lazy: a Connect DataFrame
    assert type(out).__module__.startswith("pyspark.sql.connect") and "prediction" in out.columns
    rows = out.select("pixels", "prediction").toPandas()
    X = np.stack(rows["pixels"].to_numpy()).astype("float32")
    got = np.stack(rows["prediction"].to_numpy())
    np.testing.assert_allclose(got, model.predict(X, verbose=0), atol=1e-6)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["jax", pytest.param("torch", marks=pytest.mark.full)])  # torch: classic's
def test_a_jax_or_torch_notebook_trains_over_connect_as_locally(spark, backend, no_leftover_workers):
    """Issue 25: a notebook of its own on that backend, a client of this module's server."""
    assert_remote_run(run_driver(backend, "spark", CONNECT_URL[0]), backend)


def test_unreachable_notebook_is_one_sentence_within_30_s(spark, data, no_leftover_workers):
    Xtr, _, ytr, _ = data
    started = time.monotonic()
    with pytest.raises(TrainingFailed) as info:  # TEST-NET-1 reaches nothing
        nbdist.train(small_model(), Xtr[:200], ytr[:200], epochs=1, workers=2, ui="none", advertise_host="192.0.2.1")
    elapsed = time.monotonic() - started
    message = str(info.value)
    assert "cannot reach the notebook at 192.0.2.1" in message and "advertise_host" in message, message
    assert elapsed < 30, elapsed


def test_an_rdd_over_connect_is_one_sentence(spark):
    from nbdist.spark.backend import SparkBackend
    from nbdist.spark.data import SparkData
    from nbdist.spark.task import Layout

    with pytest.raises(NbdistError, match="RDDs do not exist over Spark Connect") as info:
        SparkBackend(spark).launch(2, ("127.0.0.1", 1), b"s" * 32, 1, data=SparkData(object(), Layout()))
    assert "\n" not in str(info.value)


@pytest.mark.full("one file's rows streamed in order in equal shares: test_spark_partitions.py's one-file test; "
                  "a DataFrame streamed over Connect: test_validation_dataframe_streams_over_connect_with_exact_"
                  "metrics")
def test_one_parquet_file_streams_over_connect_in_equal_shares_in_order(spark, data, tmp_path, no_leftover_workers):
    """The issue's one Parquet file, read as two partitions of which one holds every row ([n, 0]), over
    Connect: each worker trains on an equal share (as it reports), worker 0 on the file's first half and
    worker 1 on the second, in order, so with small Arrow blocks, a window of ~100 rows, shuffle=False and
    allreduce the weights equal in-memory training on those halves; the run's note says what was done."""
    from pyspark.sql import functions as F

    Xtr, _, ytr, _ = data
    X, y = Xtr[:1000], ytr[:1000]
    _frame(spark, X, y).coalesce(1).write.parquet(str(tmp_path / "one"))
    (file,) = (tmp_path / "one").glob("*.parquet")
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", "50")
    spark.conf.set("spark.sql.files.maxPartitionBytes", str(file.stat().st_size // 2 + 1))
    try:
        df = spark.read.parquet(str(tmp_path / "one"))
        held = df.groupBy(F.spark_partition_id().alias("p")).count().collect()
        assert [r["count"] for r in held] == [1000], held  # one partition holds every row
        options = dict(epochs=2, batch_size=32, workers=2, strategy="allreduce", shuffle=False,
                       stream_buffer_bytes=100 * 65 * 4, ui="none")
        streamed, in_memory = small_model(), small_model()
        job = nbdist.train(streamed, df, features="pixels", label="digit", **options)
        assert job.state.backend == "spark" and [w.samples for w in job.state.workers] == [500, 500]
        assert [w.samples_done for w in job.state.workers] == [2 * 500] * 2  # as the workers trained, 2 epochs
        # A Connect client sees the partitions up to the last one holding rows.
        note, counts = job.state.data_note, "1 partition [1000]" if held[0]["p"] == 0 else "2 partitions [0, 1000]"
        assert note.startswith(f"rebalanced {counts} into 2 equal shares of 500 rows (counted in "), note
        nbdist.train(in_memory, X[partition_order(1000, 2, 32)], y[partition_order(1000, 2, 32)], backend="local",
                     **options)
    finally:
        spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")
        spark.conf.unset("spark.sql.files.maxPartitionBytes")
    for a, b in zip(streamed.get_weights(), in_memory.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


@pytest.mark.full
def test_a_model_without_an_input_shape_trains_over_connect(spark, data):
    """Built on a zero row as wide as the feature column, read from the Connect DataFrame's schema and first row.

    Marked full: CI covers both halves. The width read from a Connect DataFrame's schema and first row
    (spark/checks.py feature_width) runs in test_evaluate_equals_keras_incl_auc's evaluate here; the model
    built on a zero row that wide and trained is test_spark_models_and_fit.py's
    test_a_model_without_an_input_shape_trains_from_a_dataframe.
    """
    import keras

    Xtr, Xte, ytr, yte = data
    model = keras.Sequential([keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    job = nbdist.train(model, _frame(spark, Xtr, ytr), features="pixels", label="digit", epochs=2, batch_size=32,
                       workers=2, ui="none")
    assert job.status == "done" and job.state.backend == "spark" and model.layers[0].kernel.shape == (64, 16)


@pytest.mark.full("a validation DataFrame streamed with exact metrics: test_spark_stream.py's validation test")
def test_validation_dataframe_streams_over_connect_with_exact_metrics(spark, data, test_frame, no_leftover_workers):
    Xtr, Xte, ytr, yte = data
    model = small_model()
    job = nbdist.train(model, _frame(spark, Xtr[:600], ytr[:600]), features="pixels", label="digit",
                       validation_data=test_frame, epochs=1, batch_size=32, workers=2, strategy="allreduce",
                       ui="none")
    assert job.state.backend == "spark" and sum(w.samples for w in job.state.workers) == 600
    want = model.evaluate(Xte, yte, batch_size=256, verbose=0, return_dict=True)
    assert abs(job.history["val_loss"][-1] - want["loss"]) < 1e-5, (job.history, want)
    assert abs(job.history["val_accuracy"][-1] - want["accuracy"]) < 1e-5, (job.history, want)


def _started(spark, data, **options):
    """A long DataFrame training run over Connect, once its first epoch is done."""
    Xtr, _, ytr, _ = data
    config = TrainConfig(epochs=500, batch_size=8, workers=2, ui="none", **options)
    job = prepare(small_model(), config, _frame(spark, Xtr, ytr), None, None, features="pixels", label="digit").start()
    deadline = time.monotonic() + 300
    while job.state.epochs_done < 1:
        assert time.monotonic() < deadline, "training did not start"
        job.pump(0.2)
    return job


def test_killed_worker_ends_the_job_and_every_process(spark, data, monkeypatch):
    job = _started(spark, data)
    victim = job._handles[1]
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(TrainingFailed) as info:
        job.wait(timeout=60)
    assert time.monotonic() - killed_at < 20
    assert "worker 1" in str(info.value) and "SIGKILL" in str(info.value)
    job._backend._thread.join(30)
    assert not job._backend._thread.is_alive()  # collect() returned: the barrier stage is over
    assert not wait_until_no_workers(job) and not wait_no_workers(15)
    assert spark.range(10).count() == 10  # the session lives on


def test_interrupt_cancels_the_connect_job(spark, data):
    job = _started(spark, data)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        job.wait(timeout=120)
    assert job.status == "stopped"
    job._backend._thread.join(30)
    assert not job._backend._thread.is_alive()
    assert time.monotonic() - started < 45
    assert not wait_until_no_workers(job) and not wait_no_workers(15)
    assert spark.range(10).count() == 10


@pytest.mark.full("training over Connect as locally: the JAX notebook test here; both strategies on Spark tasks: "
                  "test_spark_allreduce.py, test_spark_local.py; warm executors: test_spark_warm.py")
def test_both_strategies_match_local_fit_and_warm_workers_serve_the_second_run(spark, data, warm_executors):
    Xtr, Xte, ytr, yte = data
    local = small_model()
    local.fit(Xtr, ytr, epochs=EPOCHS, batch_size=64, verbose=0)
    want = accuracy(local, Xte, yte)
    df = _frame(spark, Xtr, ytr)
    others = set(warm_socket_workers())  # other runs' on this machine (colleagues, other tests)
    runs = {}
    for strategy in ("averaging", "allreduce"):
        if strategy == "allreduce":  # the first run's tasks left one warm worker each
            socks = [sock for pid, sock in warm_socket_workers().items() if pid not in others]
            assert len(socks) == 2, socks
            wait_warm_ready(socks[0].parent, 2)
        model = small_model()
        job = nbdist.train(model, df, features="pixels", label="digit", epochs=EPOCHS, batch_size=32, workers=2,
                           strategy=strategy, seed=0, ui="none")
        assert job.status == "done" and job.state.backend == "spark"
        assert sum(w.samples for w in job.state.workers) == len(Xtr)
        runs[strategy] = (accuracy(model, Xte, yte), [w.warm for w in job._backend.workers])
    for strategy, (got, _) in runs.items():
        assert got >= want - 0.01, (strategy, got, want)
    assert runs["averaging"][1] == [False, False] and runs["allreduce"][1] == [True, True], runs


@pytest.mark.full("a search on Spark tasks: test_spark_local.py's search test; runs over Connect: this module's "
                  "training tests")
def test_a_search_runs_its_trials_over_connect(spark, data, tmp_path):
    """%%dist_tune's API with a Spark Connect session: 2 trials at once, each a run of one Spark task's
    worker; each stored value is its run's merged metric, and the best model is the best trial's. (Each trial's
    own workers are gone after it; the executors then keep warm workers for the next run, by design.)"""
    optuna = pytest.importorskip("optuna")
    Xtr, Xte, ytr, yte = data

    def build(trial):
        model = small_model(trial.number)
        model.optimizer.learning_rate = trial.suggest_float("lr", 1e-3, 3e-2, log=True)
        model.fit(Xtr, ytr, batch_size=64, epochs=1, validation_data=(Xte, yte), verbose=0)

    search = nbdist.tune(build, trials=2, parallel=2, objective="val_accuracy", backend="spark", pruner="none",
                         storage=f"sqlite:///{tmp_path / 'connect.db'}", seed=0)
    trials = search.study.get_trials()
    assert [t.state for t in trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for t in trials:
        job = search.jobs[t.number]
        assert job.state.backend == "spark" and job.status == "done"
        assert t.value == job.history["val_accuracy"][-1]
        assert not wait_until_no_workers(job)
    assert accuracy(search.best_model, Xte, yte) == pytest.approx(search.study.best_value, abs=1e-6)
