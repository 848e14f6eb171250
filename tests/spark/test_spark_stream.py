"""Spark data streamed from each task's shard file (worker/streams.py), on a real local[2] Spark.

The DataFrame keeps its two partitions (createDataFrame from pandas splits the rows in two
contiguous halves), so the in-memory run on the local backend trains each worker on the same rows.
Small Arrow batches and a small shuffle window make every epoch cross many blocks and windows.
"""
from __future__ import annotations

import numpy as np
import pytest

from ..spark_helpers import accuracy, need_spark, small_model

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
    pdf = pd.DataFrame({"pixels": list(Xtr[:n].astype("float64")), "digit": ytr[:n].astype("int64")})
    df = spark.createDataFrame(pdf)
    parts = df.rdd.glom().map(len).collect()
    assert parts == [n // 2, n // 2], parts  # contiguous halves: the local backend's shards
    firsts = df.rdd.glom().map(lambda rows: int(rows[0].digit) if rows else -1).collect()
    assert firsts == [int(ytr[0]), int(ytr[n // 2])], firsts
    return df, Xtr[:n], ytr[:n]


@pytest.mark.parametrize("strategy", ["allreduce", "averaging"])
def test_streamed_equals_in_memory_without_shuffle(frame, strategy, no_leftover_workers):
    df, X, y = frame
    options = dict(epochs=3, batch_size=32, workers=2, strategy=strategy, averaging_frequency=1, shuffle=False,
                   seed=0, stream_buffer_bytes=WINDOW_BYTES)
    streamed, in_memory = small_model(), small_model()
    job = nbdist.train(streamed, df, features="pixels", label="digit", backend="spark", **options)
    assert job.state.backend == "spark" and [w.samples for w in job.state.workers] == [len(X) // 2] * 2
    nbdist.train(in_memory, X, y, backend="local", **options)
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
