"""Equal shares of Spark data for the workers, whatever the DataFrame's or RDD's partitioning.

A barrier task reads one partition, so a skewed DataFrame (one Parquet file: [200000, 0]) would give one
worker nothing. Before the barrier stage one small job counts each partition's rows (only the counts reach
the driver). When they already give equal shares (as many partitions as workers, within a batch of each
other) the partitions are read as they are; otherwise each row goes to worker ``index * workers // rows`` of
its global index: one shuffle, spilled to disk by Spark (bounded memory), and each worker's share is a
contiguous, ordered range of floor or ceil(rows / workers) rows. The pure arithmetic comes first
(unit-tested without Spark); pyspark is imported lazily.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..data.sharding import check_workers
from .task import VALIDATION_COLUMN

INDEX_COLUMN = "__nbdist_index"  # a row's place in the data (position in the DataFrame's partition order)
KEY_COLUMN = "__nbdist_key"  # the value whose Spark hash sends the row to its worker's partition
_POSITION_BITS = 33  # monotonically_increasing_id() = partition index << 33 | position in the partition
_MASK32 = 0xFFFFFFFF


# -- pure arithmetic ----------------------------------------------------------
def worker_of(index: int, rows: int, workers: int) -> int:
    """The worker that trains on row ``index`` of ``rows``: contiguous ranges of floor/ceil(rows/workers)."""
    return min(workers - 1, index * workers // rows)


def equal_shares(rows: int, workers: int) -> list[int]:
    """Each worker's rows under ``worker_of``: worker w gets indices ceil(w*rows/W) .. ceil((w+1)*rows/W)-1."""
    starts = [-(-w * rows // workers) for w in range(workers + 1)]
    return [b - a for a, b in zip(starts, starts[1:])]


def offsets(counts: Sequence[int]) -> list[int]:
    """Each partition's first global row index."""
    out, total = [], 0
    for c in counts:
        out.append(total)
        total += int(c)
    return out


def balanced(counts: Sequence[int], workers: int, batch: int) -> bool:
    """Whether the partitions, read one per worker as they are, give equal shares: one per worker, every
    one non-empty and within a batch of the others (a 1-row batch: floor/ceil exactly)."""
    return len(counts) == workers and min(counts) > 0 and max(counts) - min(counts) < max(2, batch)


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _mix_k1(k1: int) -> int:
    k1 = (k1 * 0xCC9E2D51) & _MASK32
    return (_rotl(k1, 15) * 0x1B873593) & _MASK32


def _mix_h1(h1: int, k1: int) -> int:
    h1 = _rotl(h1 ^ k1, 13)
    return (h1 * 5 + 0xE6546B64) & _MASK32


def spark_hash_long(value: int, seed: int = 42) -> int:
    """Spark SQL's ``hash()`` of a bigint (Murmur3_x86_32.hashLong, seed 42), as a signed 32-bit int:
    what ``repartition(n, col)`` takes modulo n to pick a row's partition."""
    value &= 0xFFFFFFFFFFFFFFFF
    h1 = _mix_h1(seed & _MASK32, _mix_k1(value & _MASK32))
    h1 = _mix_h1(h1, _mix_k1(value >> 32))
    h1 ^= 8
    h1 ^= h1 >> 16
    h1 = (h1 * 0x85EBCA6B) & _MASK32
    h1 ^= h1 >> 13
    h1 = (h1 * 0xC2B2AE35) & _MASK32
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1


def partition_keys(workers: int) -> list[int]:
    """For each worker w, the smallest bigint whose Spark hash partitioning over ``workers`` partitions is w:
    a hash of 0..W-1 itself collides, and would leave some partition (worker) empty."""
    keys: dict[int, int] = {}
    candidate = 0
    while len(keys) < workers:
        keys.setdefault(spark_hash_long(candidate) % workers, candidate)  # Python's % is Spark's pmod here
        candidate += 1
    return [keys[w] for w in range(workers)]


def _shown(counts: Sequence[int], most: int = 6) -> str:
    shown = ", ".join(str(c) for c in counts[:most])
    return f"[{shown}{', ...' if len(counts) > most else ''}]"


@dataclass(frozen=True)
class Rebalance:
    """What the rebalancing found and did, for the run's first line."""

    counts: tuple[int, ...]  # rows per partition, as counted before the barrier stage
    workers: int
    seconds: float  # the counting job's time; the shuffle runs as the tasks read their shares
    shuffled: bool

    @property
    def note(self) -> str:
        """'' when the partitions were read as they are."""
        if not self.shuffled:
            return ""
        n = sum(self.counts)
        sizes = sorted(set(equal_shares(n, self.workers)))
        each = " or ".join(str(s) for s in sizes)
        parts = f"{len(self.counts)} partition{'s' if len(self.counts) != 1 else ''}"
        return (f"rebalanced {parts} {_shown(self.counts)} into {self.workers} equal shares "
                f"of {each} rows (counted in {self.seconds:.1f} s; one shuffle as the tasks read them)")


# -- Spark ----------------------------------------------------------------------
def frame_counts(df: Any, partitions: int | None = None) -> list[int]:
    """Rows per partition of a DataFrame, counted in one job (in the JVM); only the counts come back.
    ``partitions``: the DataFrame's partition count where it is known (classic sessions), so trailing
    empty ones count; a Connect client sees the partitions up to the last non-empty one."""
    from pyspark.sql import functions as F

    found = {int(r[0]): int(r[1]) for r in
             df.select(F.spark_partition_id().alias("p")).groupBy("p").count().collect()}
    size = max([partitions or 0, *(p + 1 for p in found)])
    return [found.get(p, 0) for p in range(size)]


def keyed_frame(df: Any, counts: Sequence[int], workers: int) -> Any:
    """``df`` with each row's global index and the key that sends it to its worker's partition."""
    from pyspark.sql import functions as F

    rows = sum(counts)
    keys = partition_keys(workers)
    part = F.spark_partition_id()
    position = F.monotonically_increasing_id() - F.shiftleft(part.cast("long"), _POSITION_BITS)
    # Counted partitions beyond these (a DataFrame recomputed differently) still land on a worker.
    start = F.coalesce(F.try_element_at(F.array(*[F.lit(o).cast("long") for o in offsets(counts)]), part + 1),
                       F.lit(rows).cast("long"))
    index = (start + position).alias(INDEX_COLUMN)
    # Integer division, as worker_of: index * W div rows.
    worker = F.least(F.lit(workers - 1).cast("long"), F.expr(f"{INDEX_COLUMN} * {workers} div {max(rows, 1)}"))
    key = F.element_at(F.array(*[F.lit(k).cast("long") for k in keys]), (worker + 1).cast("int"))
    return df.select("*", index).withColumn(KEY_COLUMN, key)


def shuffled_frame(keyed: Any, workers: int, keep: Sequence[str]) -> Any:
    """One partition per worker, each holding its contiguous range in order; ``keep``: the columns read."""
    return keyed.repartition(workers, KEY_COLUMN).sortWithinPartitions(INDEX_COLUMN).select(*keep)


def counted(df: Any, partitions: int | None) -> tuple[list[int], float]:
    """``frame_counts`` and the seconds its job took."""
    began = time.monotonic()
    counts = frame_counts(df, partitions)
    return counts, time.monotonic() - began


def rebalance_frame(df: Any, workers: int, batch: int, partitions: int | None,
                    must_shuffle: bool) -> tuple[Any, Rebalance]:
    """``df`` as one partition per worker with equal shares, and what it took. ``partitions``: known on
    classic sessions; ``must_shuffle``: the partitions cannot be read as they are (Connect, a barrier-unsafe
    plan), so the key-routed shuffle replaces the round-robin one even when the counts are balanced."""
    counts, seconds = counted(df, partitions)
    check_workers(sum(counts), workers)
    unequal = not balanced(counts, workers, batch)
    report = Rebalance(tuple(counts), workers, seconds, shuffled=unequal)
    if not unequal and not must_shuffle:
        return df, report
    return shuffled_frame(keyed_frame(df, counts, workers), workers, df.columns), report


def rebalance_with_validation(df: Any, validation: Any, workers: int, batch: int,
                              connect: bool) -> tuple[Any, Rebalance]:
    """One barrier stage reads both DataFrames: their union, each row marked (``VALIDATION_COLUMN``), each
    side's rows routed by its own index (one shuffle), so every task writes an equal share of each."""
    from pyspark.sql import functions as F

    marked, report = [], None
    for frame, flag in ((df, False), (validation, True)):
        counts, seconds = counted(frame, None if connect else frame._jdf.rdd().getNumPartitions())
        if report is None:
            check_workers(sum(counts), workers)
            report = Rebalance(tuple(counts), workers, seconds, shuffled=not balanced(counts, workers, batch))
        marked.append(keyed_frame(frame, counts, workers).withColumn(VALIDATION_COLUMN, F.lit(flag)))
    union = marked[0].unionByName(marked[1])
    return shuffled_frame(union, workers, [*df.columns, VALIDATION_COLUMN]), report


def rebalance_rdd(rdd: Any, workers: int, batch: int, must_shuffle: bool) -> tuple[Any, Rebalance]:
    """An RDD of pairs as one partition per worker with equal shares (classic sessions): its rows counted in
    Python (an RDD's rows exist only there), then routed by global index and sorted by it within each."""
    began = time.monotonic()
    counts = rdd.mapPartitions(lambda it: [sum(1 for _ in it)]).collect()
    seconds = time.monotonic() - began
    rows = sum(counts)
    check_workers(rows, workers)
    unequal = not balanced(counts, workers, batch)
    report = Rebalance(tuple(counts), workers, seconds, shuffled=unequal)
    if not unequal and not must_shuffle:
        return rdd, report
    starts = offsets(counts)

    def indexed(part: int, it: Any) -> Any:
        yield from enumerate(it, start=starts[part] if part < len(starts) else rows)

    shuffled = rdd.mapPartitionsWithIndex(indexed).repartitionAndSortWithinPartitions(
        workers, partitionFunc=lambda i: worker_of(i, rows, workers))
    return shuffled.values(), report

