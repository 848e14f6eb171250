"""A worker's share streamed from its shard file into Keras in bounded memory (Spark data).

The Spark task wrote the partition as blocks of rows (wire/shardfile.py). Each epoch the worker reads
them again, one at a time, and cuts them into batches (with a DataFrame's weight column, ``(x, y,
sample_weight)`` batches): shard.arrow -> read-ahead thread (``READ_AHEAD_BLOCKS``) -> shuffle window
(``stream_buffer_bytes`` of rows, ``window_batches``) -> batches -> tf.data -> ``model.fit``.
Invariant: full batches, then the short one, every epoch; unshuffled, exactly ``model.fit(x, y, batch_size,
shuffle=False)``'s on the partition's rows; shuffled, seeded by (``seed + rank``, epoch), so a resumed run
sees the uninterrupted run's order (a shuffle within windows of blocks, not one uniform permutation: see
``window_batches``). Memory: the window, the read-ahead blocks and tf.data's prefetch; never the share.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from .readahead import put_until_stopped
from .tfdata import without_autotune

log = logging.getLogger("nbdist.worker")

READ_AHEAD_BLOCKS = 4  # blocks the reader thread holds ahead of the window
READ_TIMEOUT = 300.0  # seconds one block may take to come off the disk


# -- pure logic ------------------------------------------------------------------
def window_rows(buffer_bytes: int, row_bytes: int, batch_size: int) -> int:
    """Rows the shuffle window holds: ``buffer_bytes`` worth, and never less than one batch."""
    return max(int(batch_size), int(buffer_bytes) // max(1, int(row_bytes)))


def block_order(blocks: int, shuffle: bool, rng: np.random.Generator) -> list[int]:
    return [int(i) for i in rng.permutation(blocks)] if shuffle else list(range(blocks))


def epoch_rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.default_rng([int(seed) & (2**63 - 1), int(epoch)])


def window_batches(blocks: Iterator[tuple[np.ndarray, ...]], batch_size: int, window: int,
                   shuffle: bool, rng: np.random.Generator) -> Iterator[tuple[np.ndarray, ...]]:
    """One epoch's batches from a sequence of row blocks (each a tuple of arrays with equal rows).

    With ``shuffle`` (the blocks' order already permuted by ``block_order``): fill a window of at least
    ``window`` rows from consecutive blocks, permute its rows and cut full batches; the rows left over (fewer
    than a batch) join the next window; the epoch's last batch is the short one, as Keras'. When the window
    holds the whole share this IS one uniform permutation, as Keras' ``shuffle=True``; otherwise two rows of
    the same Spark batch (up to ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows, 10000 by default) meet
    in a batch more often than under a full permutation, so data sorted by label should be repartitioned
    randomly first (``df.orderBy(F.rand())``) or given a window larger than a sorted run."""
    held: list[tuple[np.ndarray, ...]] = []
    rows = 0

    def cut(last: bool) -> Iterator[tuple[np.ndarray, ...]]:
        nonlocal held, rows
        pool = tuple(np.concatenate(parts) if len(parts) > 1 else parts[0] for parts in zip(*held))
        n = len(pool[0])
        order = rng.permutation(n) if shuffle else None
        full = n - n % batch_size
        end = n if last else full
        for start in range(0, end, batch_size):
            stop = min(start + batch_size, end)
            yield tuple(a[order[start:stop]] if order is not None else a[start:stop] for a in pool)
        rest = order[full:] if order is not None else slice(full, n)
        held = [] if last or full == n else [tuple(a[rest] for a in pool)]
        rows = 0 if last else n - full

    for block in blocks:
        if len(block[0]) == 0:
            continue
        held.append(block)
        rows += len(block[0])
        if rows >= window:
            yield from cut(last=False)
    if rows:
        yield from cut(last=True)


# -- reading the shard -------------------------------------------------------------
class ReadAhead:
    """Blocks read from the shard file by a thread, ``READ_AHEAD_BLOCKS`` ahead of the consumer."""

    def __init__(self, reader: Any, order: list[int]) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=READ_AHEAD_BLOCKS)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(reader, order), name="nbdist-read-ahead",
                                        daemon=True)
        self._thread.start()

    def _run(self, reader: Any, order: list[int]) -> None:
        try:
            for i in order:
                item: Any = reader.block(i)
                if not self._put(item):
                    return
        except BaseException as exc:  # handed to the consumer, which raises it in the training thread
            self._put(exc)
            return
        self._put(None)

    def _put(self, item: Any) -> bool:
        return put_until_stopped(self._queue, item, self._stop)

    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        try:
            while True:
                item = self._queue.get(timeout=READ_TIMEOUT)
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield tuple(a for a in item if a is not None)
        finally:
            self._stop.set()


class ShardStream:
    """Epoch after epoch of batches from a ``ShardReader``: what ``streamed_batches`` feeds to tf.data."""

    def __init__(self, reader: Any, batch_size: int, shuffle: bool, seed: int, first_epoch: int,
                 buffer_bytes: int) -> None:
        self.reader = reader
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.first_epoch = int(first_epoch)
        first = reader.block(0)  # (x, y), or (x, y, w) with a DataFrame's weight column
        row_bytes = sum(a[:1].nbytes for a in first if a is not None)
        self.window = window_rows(buffer_bytes, row_bytes, self.batch_size)
        self.signature = tuple(None if a is None else a[:0] for a in first)  # (x, y[, w]) with no rows

    def epoch(self, epoch: int) -> Iterator[tuple[np.ndarray, ...]]:
        rng = epoch_rng(self.seed, epoch)
        order = block_order(self.reader.blocks, self.shuffle, rng)
        yield from window_batches(iter(ReadAhead(self.reader, order)), self.batch_size, self.window,
                                  self.shuffle, rng)

    def __call__(self) -> Iterator[tuple[np.ndarray, ...]]:
        epoch = self.first_epoch
        while True:
            yield from self.epoch(epoch)
            epoch += 1


def streamed_batches(stream: ShardStream) -> Any:
    """The infinite tf.data.Dataset of ``(x, y)``, ``(x, y, sample_weight)`` (or ``x``) batches that
    ``model.fit`` reads."""
    import tensorflow as tf

    x0, y0 = stream.signature[:2]
    spec = lambda a: tf.TensorSpec((None, *a.shape[1:]), tf.as_dtype(a.dtype))
    signature = spec(x0) if y0 is None else tuple(spec(a) for a in stream.signature if a is not None)

    def batches() -> Iterator[Any]:
        for batch in stream():
            yield batch[0] if y0 is None else batch

    return without_autotune(tf.data.Dataset.from_generator(batches, output_signature=signature).prefetch(2))
