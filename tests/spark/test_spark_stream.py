"""Spark data streamed from each task's shard file (worker/streams.py), on a real local[2] Spark.

The DataFrame keeps its two partitions (createDataFrame from pandas splits the rows in two
contiguous halves), so the in-memory run on the local backend trains each worker on the same rows.
Small Arrow batches and a small shuffle window make every epoch cross many blocks and windows.
"""
from __future__ import annotations

import threading

import numpy as np
import psutil
import pytest

from ..memory_cgroup import join, memory_cgroup, peak_usage
from ..spark_helpers import accuracy, need_spark, partition_order, small_model

need_spark()

import nbdist  # noqa: E402

ROWS_PER_BLOCK = 50  # spark.sql.execution.arrow.maxRecordsPerBatch: the task's blocks
WINDOW_BYTES = 100 * 65 * 4  # about 100 rows of 64 float32 features and a label


@pytest.fixture(scope="module")
def frame(spark, data):
    import pandas as pd

    Xtr, _, ytr, _ = data
    n = len(Xtr) - len(Xtr) % 2
    spark.conf.set("spark.sql.execution.arrow.maxRecordsPerBatch", str(ROWS_PER_BLOCK))
    pdf = pd.DataFrame({"pixels": Xtr[:n].astype("float64").tolist(), "digit": ytr[:n].astype("int64")})
    df = spark.createDataFrame(pdf)
    parts = df.rdd.glom().map(len).collect()
    assert parts == [n // 2, n // 2], parts  # contiguous halves: the local backend's shards
    firsts = df.rdd.glom().map(lambda rows: int(rows[0].digit) if rows else -1).collect()
    assert firsts == [int(ytr[0]), int(ytr[n // 2])], firsts
    yield df, Xtr[:n], ytr[:n]
    spark.conf.unset("spark.sql.execution.arrow.maxRecordsPerBatch")  # the session outlives this module


@pytest.mark.parametrize("strategy", ["allreduce", pytest.param("averaging", marks=pytest.mark.full(
    "the same streamed rows: the allreduce case; averaging's rounds: tests/workers/test_training.py"))])
def test_streamed_equals_in_memory_without_shuffle(frame, strategy, no_leftover_workers):
    df, X, y = frame
    options = dict(epochs=2, batch_size=32, workers=2, strategy=strategy, averaging_frequency=1, shuffle=False,
                   seed=0, stream_buffer_bytes=WINDOW_BYTES)
    streamed, in_memory = small_model(), small_model()
    job = nbdist.train(streamed, df, features="pixels", label="digit", backend="spark", **options)
    assert job.state.backend == "spark" and [w.samples for w in job.state.workers] == [len(X) // 2] * 2
    order = partition_order(len(X), 2, 32)
    nbdist.train(in_memory, X[order], y[order], backend="local", **options)
    for a, b in zip(streamed.get_weights(), in_memory.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_streamed_shuffle_trains_as_well_as_in_memory(frame, data, no_leftover_workers):
    df, X, y = frame
    _, Xte, _, yte = data
    options = dict(epochs=12, batch_size=32, workers=2, strategy="allreduce", seed=0)
    streamed, in_memory = small_model(), small_model()
    nbdist.train(streamed, df, features="pixels", label="digit", backend="spark", stream_buffer_bytes=WINDOW_BYTES,
                 **options)
    nbdist.train(in_memory, X, y, backend="local", **options)
    assert accuracy(streamed, Xte, yte) >= accuracy(in_memory, Xte, yte) - 0.01


def test_validation_dataframe_on_the_magic_line_streams_with_exact_metrics(spark, frame, data, no_leftover_workers):
    """``--validation-data val_df`` beside ``--data df``: each task writes its share of both, the workers
    stream both, and the merged validation metrics are Keras' own on every validation row."""
    import pandas as pd

    from ..conftest import ipython_shell

    df, _, _ = frame
    _, Xte, _, yte = data
    val = spark.createDataFrame(pd.DataFrame({"pixels": Xte.astype("float64").tolist(), "digit": yte.astype("int64")}))
    shell = ipython_shell()
    shell.user_ns.update(df=df, val_df=val, small_model=small_model)
    shell.run_cell_magic("dist_train", "--data df --features pixels --label digit --validation-data val_df "
                         "--backend spark --workers 2 --strategy allreduce --epochs 1 --batch-size 32 "
                         "--stream-buffer 1 --ui none --out vhist",
                         "model = small_model()")
    job, model = shell.user_ns["vhist_job"], shell.user_ns["model"]
    assert job.status == "done" and job.state.backend == "spark"
    want = model.evaluate(Xte, yte, batch_size=256, verbose=0, return_dict=True)
    got = shell.user_ns["vhist"]
    assert abs(got["val_loss"][-1] - want["loss"]) < 1e-5, (got, want)
    assert abs(got["val_accuracy"][-1] - want["accuracy"]) < 1e-5, (got, want)


def test_a_validation_dataframe_of_other_column_types_is_one_sentence(spark, frame):
    from pyspark.sql import functions as F

    from nbdist.errors import NbdistError

    df, _, _ = frame
    val = df.withColumn("digit", F.col("digit").cast("double"))
    with pytest.raises(NbdistError, match="validation DataFrame column 'digit' is double") as info:
        nbdist.train(small_model(), df, features="pixels", label="digit", validation_data=val, backend="spark")
    assert "\n" not in str(info.value)


def test_a_relaunched_run_writes_and_streams_every_partition_afresh(spark, frame, data, no_leftover_workers):
    """The Python process of worker 1's Spark task killed mid-run (its worker dies with it), as a lost executor
    takes it: Spark never retries a failed barrier ResultStage (it aborts the job, "Could not recover from a
    failed barrier ResultStage", whatever spark.task.maxFailures allows; tried with local[2,3] too), so the
    cause names the lost task in one sentence, and with max_restarts nbdist relaunches a new barrier stage
    whose tasks write their partitions (training and validation) afresh and whose workers stream them: the
    run ends with every row and exact validation."""
    import os
    import signal

    import pandas as pd

    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    df, X, _ = frame
    _, Xte, _, yte = data
    val = spark.createDataFrame(pd.DataFrame({"pixels": Xte.astype("float64").tolist(), "digit": yte.astype("int64")}))
    tasks: list[str] = []  # the killed task process's command line
    causes: list[str] = []

    def kill(kind, state, payload):
        if kind == "restart":
            causes.append(str(payload))
        # At worker 1's first progress report, inside epoch 1: at the first merged epoch a loaded machine's driver
        # could be so far behind the workers that they had ended all three epochs, and nothing was left to kill.
        if kind == "progress" and payload == 1 and not tasks and state.workers[1].state == "training" \
                and state.workers[1].pid is not None:
            task = psutil.Process(state.workers[1].pid).parent()  # the task's pyspark worker process
            tasks.append(" ".join(task.cmdline()))
            os.kill(task.pid, signal.SIGKILL)

    model = small_model()
    # Three epochs: the restart trains the rest from the last merged epoch (none here: from the start).
    # Cold workers: the task's process is found as its worker's parent (a warm worker's is not the task).
    config = TrainConfig(epochs=3, batch_size=32, workers=2, strategy="allreduce", backend="spark", max_restarts=1,
                         ui="none", stream_buffer_bytes=WINDOW_BYTES, warm_workers=False)
    job = prepare(model, config, df, None, val, features="pixels", label="digit", listeners=[kill])
    job.start()
    job.wait(timeout=600)
    assert tasks and "pyspark" in tasks[0], tasks
    assert len(causes) == 1 and "worker 1 (Spark task 1" in causes[0] and "was lost with its Spark task" in causes[0] \
        and "\n" not in causes[0], causes
    assert job.status == "done" and job.state.restarts == 1
    assert sum(w.samples for w in job.state.workers) == len(X) and len(job.history["val_loss"]) == 3
    want = model.evaluate(Xte, yte, batch_size=256, verbose=0, return_dict=True)
    assert abs(job.history["val_loss"][-1] - want["loss"]) < 1e-5, (job.history, want)


@pytest.mark.parametrize("where", ["x", "validation_data"])
def test_spark_data_in_model_fit_is_one_sentence_naming_the_way(spark, frame, where):
    """The cell's own model.fit (and nbdist.train's in-memory path) has no arguments naming columns."""
    from nbdist.api import fit_arguments, prepare_fit
    from nbdist.config import TrainConfig
    from nbdist.errors import NbdistError

    df, X, y = frame
    given = {"x": df, "y": None} if where == "x" else {"x": X, "y": y, "validation_data": df}
    fit = fit_arguments(given.pop("x"), given.pop("y"), TrainConfig(), **given)
    model = small_model()
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(NbdistError, match="--data df --features" if where == "x" else "needs a training DataFrame") \
            as info:
        prepare_fit(model, TrainConfig(), fit, None)
    assert "\n" not in str(info.value)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))


CAP_BYTES = 800 * 2**20  # charged here: a worker starts at ~400 MB; whole-file loading adds ~2.6x the share
CAP_ROWS = 1_200_000  # 64 float32 features and a label: a 312 MB share for the one worker


def move_workers(job, cgroup: str, stop: threading.Event) -> None:
    """Put the job's worker into ``cgroup`` as soon as it starts: within 50 ms, before it imports TensorFlow."""
    host, port = job._coordinator.address
    moved: set[int] = set()
    while not stop.wait(0.05):
        for p in psutil.process_iter(["cmdline"]):
            cmd = p.info.get("cmdline") or []
            if p.pid not in moved and "nbdist.worker" in cmd and f"{host}:{port}" in cmd:
                join(cgroup, p.pid)
                moved.add(p.pid)


def test_a_worker_capped_below_whole_file_loading_trains_by_streaming(spark, no_leftover_workers):
    import keras
    from pyspark.sql import functions as F

    with memory_cgroup(CAP_BYTES) as cgroup:
        features = F.array(*[F.rand(seed=i).cast("float") for i in range(64)])
        df = spark.range(0, CAP_ROWS, numPartitions=1).select(features.alias("x"), (F.rand(seed=99) > 0.5)
                                                               .cast("int").alias("y"))
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(2, activation="softmax")])
        model.compile("sgd", "sparse_categorical_crossentropy")
        # A cold worker: moved into the group before it imports TensorFlow, not a warm one imported outside it.
        job = nbdist.train(model, df, features="x", label="y", epochs=1, batch_size=4096, workers=1,
                           backend="spark", background=True, warm_workers=False)
        stop = threading.Event()
        mover = threading.Thread(target=move_workers, args=(job, cgroup, stop), daemon=True)
        mover.start()
        try:
            job.wait(timeout=600)
        finally:
            stop.set()
            mover.join()
        peak = peak_usage(cgroup)
    assert peak > 300 * 2**20, peak  # the worker was in the group while it trained
    assert job.status == "done" and job.state.workers[0].samples == CAP_ROWS


def _weighted_model() -> object:
    import keras

    model = small_model()
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"],
                  weighted_metrics=[keras.metrics.SparseCategoricalAccuracy(name="w_acc")])
    return model


def test_a_weight_column_is_sample_weight_for_training_and_evaluation(spark, frame, data, no_leftover_workers):
    """A DataFrame's weight column (zero on half the rows) is ``model.fit``'s ``sample_weight``: allreduce on
    2 Spark workers without shuffle ends as ``model.fit(x, y, sample_weight=w)`` on the same global batches,
    History and weights (a validation DataFrame without the column weighs every row 1, as fit's
    ``validation_data=(x, y)``); and ``%dist_evaluate --weight-col`` gives ``model.evaluate(..., sample_weight=w)``."""
    import pandas as pd

    from ..conftest import ipython_shell

    _, X, y = frame
    _, Xte, _, yte = data
    rng = np.random.default_rng(0)
    w = np.where(rng.random(len(X)) < 0.5, 0.0, rng.uniform(0.5, 2.0, len(X))).astype("float32")
    pdf = pd.DataFrame({"pixels": X.astype("float64").tolist(), "digit": y.astype("int64"), "w": w.astype("float64")})
    df = spark.createDataFrame(pdf)
    val = spark.createDataFrame(pd.DataFrame({"pixels": Xte.astype("float64").tolist(), "digit": yte.astype("int64")}))
    streamed = _weighted_model()
    job = nbdist.train(streamed, df, features="pixels", label="digit", weight_col="w", validation_data=val,
                       backend="spark", epochs=2, batch_size=32, workers=2, strategy="allreduce", shuffle=False,
                       lr_scaling="none", seed=0, stream_buffer_bytes=WINDOW_BYTES)
    assert job.state.backend == "spark"
    order = partition_order(len(X), 2, 32)
    local = _weighted_model()
    want = local.fit(X[order], y[order], sample_weight=w[order], batch_size=64, epochs=2, shuffle=False,
                     validation_data=(Xte, yte), verbose=0).history
    for key in ("loss", "accuracy", "w_acc", "val_loss", "val_w_acc"):
        np.testing.assert_allclose(job.history[key], want[key], atol=1e-5, err_msg=key)
    for a, b in zip(streamed.get_weights(), local.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)
    unweighted = _weighted_model()  # the zero weights change the result, as they do locally
    unweighted.fit(X[order], y[order], batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert max(np.abs(a - b).max() for a, b in zip(unweighted.get_weights(), local.get_weights())) > 1e-2

    wte = np.where(np.arange(len(Xte)) % 2 == 0, 0.0, 1.0 + (yte % 3)).astype("float32")
    test_df = spark.createDataFrame(pd.DataFrame({"pixels": Xte.astype("float64").tolist(),
                                                  "digit": yte.astype("int64"), "wt": wte.astype("float64")}))
    shell = ipython_shell()
    shell.user_ns.update(weighted=streamed, test_df=test_df)
    shell.run_line_magic("dist_evaluate", "weighted --data test_df --features pixels --label digit --weight-col wt "
                                          "--backend spark --workers 2 --out wev")
    got = shell.user_ns["wev"]
    expect = streamed.evaluate(Xte, yte, sample_weight=wte, batch_size=256, verbose=0, return_dict=True)
    for key in ("loss", "accuracy", "w_acc"):
        assert abs(got[key] - expect[key]) < 1e-5, (key, got, expect)
    plain = streamed.evaluate(Xte, yte, batch_size=256, verbose=0, return_dict=True)
    assert abs(plain["loss"] - expect["loss"]) > 1e-3 and got["samples"] == len(Xte)


@pytest.mark.filterwarnings("ignore:the model has never been trained")
def test_a_bad_weight_column_is_one_sentence(spark, frame):
    """Refused at the door, before any Spark job: each problem named with its fix; RDDs and in-memory data
    have no columns to name."""
    from pyspark.sql import functions as F

    from nbdist.errors import NbdistError

    df, X, y = frame
    df = df.withColumn("w", F.lit(1.0)).withColumn("tag", F.lit("a"))
    cases = [(dict(weight_col="nope"), "no weight column 'nope'"),
             (dict(weight_col="tag"), "weight column 'tag' is string, not a number"),
             (dict(weight_col="digit"), "weight column 'digit' is also the label"),
             (dict(weight_col="pixels"), "weight column 'pixels' is also a feature column")]
    for kwargs, message in cases:
        for call in (nbdist.train, nbdist.evaluate):
            with pytest.raises(NbdistError, match=message) as info:
                call(small_model(), df, features="pixels", label="digit", backend="spark", **kwargs)
            assert "\n" not in str(info.value)
    with pytest.raises(NbdistError, match="pass the weights themselves as sample_weight"):
        nbdist.train(small_model(), X, y, weight_col="w", backend="local")
    from IPython.core.error import UsageError

    from ..conftest import ipython_shell

    shell = ipython_shell()
    shell.user_ns.update(df=df)
    with pytest.raises(UsageError, match="weight column 'tag' is string"):  # before the cell runs
        shell.run_cell_magic("dist_train", "--data df --features pixels --label digit --weight-col tag "
                             "--backend spark --ui none", "model = small_model()")
