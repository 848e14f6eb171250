"""The share arithmetic of Spark rebalancing (nbdist/spark/balance.py): no JVM, milliseconds."""
from __future__ import annotations

import io
import itertools

import pytest

from nbdist.driver.state import RunState
from nbdist.spark.balance import Rebalance, balanced, equal_shares, offsets, partition_keys, spark_hash_long, worker_of
from nbdist.ui.text import TextRenderer


@pytest.mark.parametrize("rows,workers", [(1, 1), (2, 2), (250, 2), (7, 3), (1000, 7), (10**6 + 3, 8), (5, 5)])
def test_rows_routed_by_global_index_make_contiguous_floor_or_ceil_shares(rows, workers):
    routed = [worker_of(i, rows, workers) for i in range(min(rows, 5000))] if rows <= 5000 else None
    shares = equal_shares(rows, workers)
    assert sum(shares) == rows and max(shares) - min(shares) <= 1 and min(shares) == rows // workers
    if routed is not None:  # each worker a contiguous range, in order, of its share's size
        assert routed == sorted(routed)
        assert [len(list(g)) for _, g in itertools.groupby(routed)] == shares


def test_partition_offsets_give_each_row_its_global_index():
    counts = [0, 3, 0, 0, 2, 5]
    starts = offsets(counts)
    assert starts == [0, 0, 3, 3, 3, 5]
    flat = [starts[p] + i for p, c in enumerate(counts) for i in range(c)]
    assert flat == list(range(sum(counts)))


@pytest.mark.parametrize("counts,workers,batch,ok", [
    ([200000, 0], 2, 32, False),  # the one Parquet file
    ([100, 100], 2, 32, True),
    ([101, 100], 2, 1, True),  # floor/ceil even with one-row batches
    ([102, 100], 2, 1, False),
    ([130, 100], 2, 32, True),  # within a batch: read as they are
    ([132, 100], 2, 32, False),
    ([50, 50, 50], 2, 32, False),  # more partitions than workers
    ([100], 2, 32, False),  # fewer
])
def test_partitions_are_read_as_they_are_only_when_they_give_equal_shares(counts, workers, batch, ok):
    assert balanced(counts, workers, batch) is ok


def test_the_hash_is_spark_sqls_and_the_keys_reach_every_partition():
    # Values of Spark 4's SQL hash() of these bigints (spark.range/F.hash), so no JVM is needed here.
    spark = {0: -1670924195, 1: -1712319331, 2: -797927272, 3: 519220707, 7: 1293116811, 42: 1316951768,
             -1: -939490007, 2**40 + 5: 114939922, -(2**35): -1299790229}
    assert {v: spark_hash_long(v) for v in spark} == spark
    for workers in range(1, 33):
        keys = partition_keys(workers)
        assert [spark_hash_long(k) % workers for k in keys] == list(range(workers))
    assert len({spark_hash_long(k) % 2 for k in range(2)}) == 1  # why keys: 0 and 1 both hash to partition 1


def test_the_first_line_says_what_was_rebalanced_and_the_cost():
    report = Rebalance((200000, 0), 2, 3.14, shuffled=True)
    assert report.note == ("rebalanced 2 partitions [200000, 0] into 2 equal shares of 100000 rows "
                           "(counted in 3.1 s; one shuffle as the tasks read them)")
    many = Rebalance(tuple(range(10)), 4, 0.04, shuffled=True)
    assert "10 partitions [0, 1, 2, 3, 4, 5, ...] into 4 equal shares of 11 or 12 rows" in many.note
    assert Rebalance((5, 5), 2, 0.1, shuffled=False).note == ""
    assert Rebalance((7,), 2, 0.1, shuffled=True).note.startswith("rebalanced 1 partition [7] into 2 equal shares")
    out = io.StringIO()
    state = RunState(2, 3, backend="spark", strategy="allreduce", data_note=report.note)
    TextRenderer(out)("start", state, None)
    assert out.getvalue() == f"nbdist: allreduce on 2 spark workers, 3 epochs; {report.note}\n"

