"""Any partitioning of a DataFrame or RDD trains with equal shares (spark/balance.py), on a real local[2] Spark.

Each case is one short run (1 epoch, 2 workers, about two batches each); the shares are checked as the
workers report the samples they trained on. One Parquet file read as two partitions holds all its rows in
one of them (its one row group belongs to the split holding its middle): the issue's [200000, 0].
"""
from __future__ import annotations

import numpy as np
import pytest

from ..spark_helpers import need_spark, partition_order, small_model

need_spark()

import nbdist  # noqa: E402
from nbdist.spark.balance import equal_shares  # noqa: E402

ROWS = 250  # odd share sizes (125 is not a multiple of the batch) and an odd row count in some cases
BATCH = 64


def one_file_frame(spark, pdf, directory) -> object:
    """A DataFrame read from one Parquet file of one row group, split in two byte ranges: [rows, 0].
    Spark plans the splits when a job runs: the caller unsets the setting afterwards (``split_setting``)."""
    spark.createDataFrame(pdf).coalesce(1).write.parquet(str(directory))
    files = sorted(directory.glob("*.parquet"))
    assert len(files) == 1, files
    spark.conf.set("spark.sql.files.maxPartitionBytes", str(files[0].stat().st_size // 2 + 1))
    return spark.read.parquet(str(directory))


@pytest.fixture
def split_setting(spark):
    yield
    spark.conf.unset("spark.sql.files.maxPartitionBytes")


def partition_sizes(df) -> list[int]:
    return df.rdd.glom().map(len).collect()  # the test's own check of the layout: tiny data


@pytest.fixture(scope="module")
def rows(data):
    import pandas as pd

    Xtr, _, ytr, _ = data
    X, y = Xtr[:ROWS], ytr[:ROWS]
    pixels = X.astype("float64").tolist()
    return X, y, pd.DataFrame({"i": np.arange(ROWS), "pixels": pixels, "digit": y.astype("int64")})


def frame(spark, rows, case, tmp_path):
    """The DataFrame of each partitioning and its partitions' sizes, as the test expects them."""
    _, _, pdf = rows
    if case == "one file [n, 0]":
        df, want = one_file_frame(spark, pdf, tmp_path / "one"), [ROWS, 0]
    else:
        tuples = [(int(r.i), [float(v) for v in r.pixels], int(r.digit)) for r in pdf.itertuples()]

        def sliced(k):  # k contiguous slices of equal size
            return spark.createDataFrame(spark.sparkContext.parallelize(tuples, k),
                                         "i long, pixels array<double>, digit long")

        if case == "skewed [125, 15]":
            df, want = sliced(2).filter("i < 140"), [125, 15]
        elif case == "one partition":
            df, want = sliced(1), [ROWS]
        elif case == "empty partitions [0, 50, 50, 33, 0]":
            df, want = sliced(5).filter("i >= 50 and i < 183"), [0, 50, 50, 33, 0]
        else:  # more partitions than workers, all holding rows: odd sizes
            df, want = sliced(7), None
    sizes = partition_sizes(df)
    if want is not None:
        assert sizes == want or sizes == want[::-1], sizes
    else:
        assert len(sizes) == 7 and sum(sizes) == ROWS, sizes
    return df, sizes


# The one-file case runs in test_one_file_streams_its_rows_in_order_and_says_so_first.
CASES = [pytest.param("skewed [125, 15]", marks=pytest.mark.full(
             "skewed partitions dealt in equal shares: test_a_skewed_rdd_trains_with_equal_shares")),
         pytest.param("one partition", marks=pytest.mark.full(
             "one partition's rows split between both workers: the one-file test below")),
         "empty partitions [0, 50, 50, 33, 0]",
         pytest.param("more partitions than workers", marks=pytest.mark.full(
             "several partitions joined into each share: the [0, 50, 50, 33, 0] case"))]


@pytest.mark.parametrize("case", CASES)
def test_every_partitioning_trains_with_equal_shares(spark, rows, case, tmp_path, split_setting,
                                                     no_leftover_workers):
    df, sizes = frame(spark, rows, case, tmp_path)
    n = sum(sizes)
    model = small_model()
    job = nbdist.train(model, df.select("pixels", "digit"), features="pixels", label="digit", epochs=1,
                       batch_size=BATCH, workers=2, backend="spark", ui="none")
    assert job.status == "done" and job.state.backend == "spark"
    want = equal_shares(n, 2)
    assert [w.samples for w in job.state.workers] == want, (sizes, job.state.workers)  # as the tasks wrote them
    assert [w.samples_done for w in job.state.workers] == want  # as the workers trained on them
    balanced = len(sizes) == 2 and abs(sizes[0] - sizes[1]) < BATCH and min(sizes) > 0
    note = job.state.data_note
    assert (note == "") == balanced, note
    if note:
        parts = "1 partition" if len(sizes) == 1 else f"{len(sizes)} partitions"
        assert note.startswith(f"rebalanced {parts} [") and "into 2 equal shares" in note, note


def test_one_file_streams_its_rows_in_order_and_says_so_first(spark, rows, tmp_path, capsys, split_setting,
                                                              no_leftover_workers):
    """[n, 0], shuffle=False: worker 0 trains on the file's first half, worker 1 on the second, in order, so
    the weights equal in-memory training on those halves; the run's first line names the rebalancing."""
    X, y, pdf = rows
    df = one_file_frame(spark, pdf, tmp_path / "one").select("pixels", "digit")
    options = dict(epochs=1, batch_size=BATCH, workers=2, strategy="allreduce", shuffle=False)
    streamed, in_memory = small_model(), small_model()
    job = nbdist.train(streamed, df, features="pixels", label="digit", backend="spark", ui="text", **options)
    assert [w.samples_done for w in job.state.workers] == [ROWS // 2] * 2
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("nbdist: allreduce on 2 spark workers, 1 epochs; rebalanced 2 partitions ") \
        and f"into 2 equal shares of {ROWS // 2} rows (counted in " in first, first
    order = partition_order(ROWS, 2, BATCH)
    nbdist.train(in_memory, X[order], y[order], backend="local", ui="none", **options)
    for a, b in zip(streamed.get_weights(), in_memory.get_weights()):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_a_skewed_rdd_trains_with_equal_shares(spark, data, no_leftover_workers):
    """An RDD of pairs with two partitions, one nearly empty after a filter (barrier-safe, so read as it was)."""
    Xtr, _, ytr, _ = data
    pairs = list(zip(Xtr[:ROWS].tolist(), ytr[:ROWS].tolist()))
    rdd = spark.sparkContext.parallelize(list(enumerate(pairs)), 2).filter(lambda r: r[0] < ROWS // 2 + 9)
    rdd = rdd.map(lambda r: r[1])
    assert rdd.glom().map(len).collect() == [ROWS // 2, 9]
    job = nbdist.train(small_model(), rdd, epochs=1, batch_size=BATCH, workers=2, backend="spark", ui="none")
    want = equal_shares(ROWS // 2 + 9, 2)
    assert job.status == "done" and [w.samples_done for w in job.state.workers] == want
    assert job.state.data_note.startswith("rebalanced 2 partitions [125, 9] into 2 equal shares of 67 rows")
