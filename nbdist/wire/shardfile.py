"""The shard file: how a Spark task hands its partition to the worker it starts on the same executor.

The task appends its rows, a block at a time as Spark delivers them, to one Arrow IPC file (``shard.arrow``)
on the executor's local disk, in the directory it names in ``NBDIST_DATA_DIR``: column ``x`` (a fixed-size
list of float32 per row), with labels ``y``, with a DataFrame's weight column ``w`` (float32 sample
weights). The IPC *file* format ends in a footer that locates every block, so the worker reads any block on
its own (``ShardReader.block``) and streams its share in bounded memory, in any order (worker/streams.py).
Plain Arrow buffers, never pickles. Not Parquet: the rows are decoded numbers read once per epoch on the same
machine, and an IPC block is the arrays themselves. ``pyarrow.dataset``'s ``to_batches`` is avoided on
purpose: it accumulates memory on long reads (apache/arrow#39808).
"""
from __future__ import annotations

import errno
import os
import struct
from collections.abc import Sequence

import numpy as np

DATA_ENV = "NBDIST_DATA_DIR"  # internal: a Spark task tells its worker where it wrote the shard
SHARD_FILE = "shard.arrow"
VALIDATION_DIR = "validation"  # beside the training shard: the task's share of a validation DataFrame
ROWS_FILE = "shard.rows"  # int64 row count of every block, written last: the reader sizes epochs from it
NPY_HEADER_SIZE = 128  # fixed, so the shape can be written after streaming the rows


class DiskFull(OSError):
    """The executor's local directory filled up while the task wrote its partition."""


def npy_header(dtype: np.dtype, shape: Sequence[int], size: int = NPY_HEADER_SIZE) -> bytes:
    """A version 1.0 .npy header padded to exactly ``size`` bytes (a multiple of 64)."""
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    text = repr({"descr": descr, "fortran_order": False, "shape": tuple(int(s) for s in shape)}).encode("latin1")
    room = size - 10  # magic (6) + version (2) + length (2)
    if len(text) + 1 > room:
        raise ValueError(f"shape {tuple(shape)} does not fit a {size}-byte npy header")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", room) + text + b" " * (room - len(text) - 1) + b"\n"


class ShardWriter:
    """Append (x, y) or (x, y, w) row blocks to ``directory``/shard.arrow; never holds more than one block.

    ``labels``: whether blocks carry y; ``weights``: whether they carry w, each row's sample weight.
    The file is opened at the first non-empty block (its schema needs the row width); a partition
    without rows leaves no file (``ShardReader`` reads it as zero rows).
    """

    def __init__(self, directory: str, labels: bool, weights: bool = False) -> None:
        self.path = os.path.join(directory, SHARD_FILE)
        self.labels = labels
        self.weights = weights
        self.rows = 0
        self.block_rows: list[int] = []
        self.width: int | None = None
        self.y_dtype: np.dtype | None = None
        self.y_width: int | None = None  # values per row of vector labels; None: one label per row
        self._sink = None
        self._writer = None

    def append(self, x: np.ndarray, y: np.ndarray | None, what: str = "the features",
               w: np.ndarray | None = None) -> None:
        import pyarrow as pa

        if len(x) == 0:
            return
        x = np.ascontiguousarray(x, dtype=np.float32).reshape(len(x), -1)
        if self.width is None:
            self.width = x.shape[1]
            self.y_dtype = None if y is None else np.asarray(y).dtype
            self.y_width = None if y is None or np.ndim(y) < 2 else int(np.prod(np.shape(y)[1:]))
            fields = [("x", pa.list_(pa.float32(), self.width))]
            if self.labels:  # a label per row, or a vector of them (one-hot, multi-label, several targets)
                kind = pa.from_numpy_dtype(self.y_dtype)
                fields.append(("y", kind if self.y_width is None else pa.list_(kind, self.y_width)))
            if self.weights:
                fields.append(("w", pa.float32()))
            self._sink = pa.OSFile(self.path, "wb")
            self._writer = pa.ipc.new_file(self._sink, pa.schema(fields))
        elif x.shape[1] != self.width:
            raise ValueError(f"{what} has {x.shape[1]} values in some rows but {self.width} in others; "
                             "every row needs the same number of values.")
        columns = [pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), self.width)]
        if self.labels:
            y = np.asarray(y, dtype=self.y_dtype)
            if (self.y_width is None) != (y.ndim < 2) or (y.ndim > 1 and y[:1].size != self.y_width):
                raise ValueError(f"the labels have {y[:1].size} values in some rows but {self.y_width or 1} in "
                                 "others; every row needs the same number of label values.")
            columns.append(pa.array(y) if self.y_width is None
                           else pa.FixedSizeListArray.from_arrays(pa.array(y.ravel()), self.y_width))
        names = ["x", "y"][:len(columns)]
        if self.weights:
            columns.append(pa.array(np.asarray(w, dtype=np.float32).reshape(len(x))))
            names.append("w")
        try:
            self._writer.write_batch(pa.RecordBatch.from_arrays(columns, names))
        except OSError as exc:
            raise disk_error(exc, self.path) from None
        self.rows += len(x)
        self.block_rows.append(len(x))

    def close(self) -> None:
        if self._writer is None:
            return
        try:
            self._writer.close()
            with open(os.path.join(os.path.dirname(self.path), ROWS_FILE), "wb") as f:
                f.write(np.asarray(self.block_rows, dtype="<i8").tobytes())
        except OSError as exc:
            raise disk_error(exc, self.path) from None
        finally:
            self._sink.close()
            self._writer = None


def disk_error(exc: OSError, path: str) -> OSError:
    """A full disk named as such (with the directory to free or move), else the error as it was."""
    if getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in str(exc):
        return DiskFull(errno.ENOSPC, f"the executor's local directory {os.path.dirname(path)} is full while "
                                      "writing this worker's partition; free space there or point "
                                      "spark.local.dir (SPARK_LOCAL_DIRS) or TMPDIR at a larger disk.")
    return exc


class ShardReader:
    """The worker's side: the blocks its task wrote, each read on its own from disk."""

    def __init__(self, directory: str | None = None) -> None:
        import pyarrow as pa

        directory = directory or os.environ.get(DATA_ENV)
        if not directory:
            raise RuntimeError(f"the job says the data is on this executor but {DATA_ENV} is not set")
        self.path = os.path.join(directory, SHARD_FILE)
        self._file = pa.OSFile(self.path, "rb") if os.path.exists(self.path) else None
        self._reader = pa.ipc.open_file(self._file) if self._file is not None else None
        self.block_rows: list[int] = []
        if self._reader is not None:  # row counts per block from the task's list: reading them reads no rows
            counts = np.fromfile(os.path.join(directory, ROWS_FILE), dtype="<i8")
            if len(counts) != self._reader.num_record_batches:
                raise RuntimeError(f"{self.path} holds {self._reader.num_record_batches} blocks but its row "
                                   f"list {len(counts)}: the task did not finish writing it")
            self.block_rows = [int(c) for c in counts]
        self.rows = int(sum(self.block_rows))
        self.labels = self._reader is not None and self._reader.schema.get_field_index("y") >= 0
        self.weights = self._reader is not None and self._reader.schema.get_field_index("w") >= 0

    @property
    def blocks(self) -> int:
        return len(self.block_rows)

    def block(self, i: int) -> tuple[np.ndarray | None, ...]:
        """Block ``i`` as numpy arrays, read from disk now: (x float32 (rows, width), y or None), or with a
        weight column (x, y, w), as ``model.fit``'s data tuples."""
        batch = self._reader.get_batch(i)
        col = batch.column(0)
        x = col.flatten().to_numpy().reshape(batch.num_rows, col.type.list_size)
        y = None
        if self.labels:
            ycol = batch.column(1)
            y = ycol.to_numpy() if not hasattr(ycol.type, "list_size") else \
                ycol.flatten().to_numpy().reshape(batch.num_rows, ycol.type.list_size)
        return (x, y, batch.column("w").to_numpy()) if self.weights else (x, y)

    def read_all(self) -> tuple[np.ndarray | None, ...]:
        """Every row at once (evaluation and prediction, which read their shard whole), as ``block``'s tuple."""
        if not self.blocks:
            return np.zeros((0, 1), np.float32), (np.zeros(0, np.float32) if self.labels else None)
        parts = [self.block(i) for i in range(self.blocks)]
        return tuple(None if part is None else np.concatenate([p[k] for p in parts])
                     for k, part in enumerate(parts[0]))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = self._reader = None


def load_task_data(directory: str | None = None) -> tuple[np.ndarray | None, ...]:
    """What the task wrote, whole (evaluation and prediction; training streams it): (x, y) or (x, y, w)."""
    reader = ShardReader(directory)
    try:
        return reader.read_all()
    finally:
        reader.close()


class NpyRows:
    """A local worker's rows of the notebook's memory-mapped .npy (``JobMessage.data_file``: a range, or
    its dealt rows of every global batch), read a block at a time with positional file reads (no memory
    map: its pages would stay in the worker's RSS), the labels from the job (already in that order).
    The same interface as ``ShardReader`` for worker/streams.py."""

    BLOCK_BYTES = 4 * 2**20

    def __init__(self, data_file: dict, y: np.ndarray | None) -> None:
        from ..data.files import file_index

        self.path = str(data_file["path"])
        self.dtype = np.dtype(data_file["dtype"])
        self.row_shape = tuple(int(s) for s in data_file["shape"][1:])
        self.row_bytes = int(np.prod(self.row_shape, dtype=np.int64)) * self.dtype.itemsize
        self.offset = int(data_file["offset"])
        self.index = file_index(data_file)
        self.y = y
        self.labels = y is not None
        self.rows = len(self.index)
        step = max(1, self.BLOCK_BYTES // max(1, self.row_bytes))
        self._starts = list(range(0, self.rows, step))
        self.block_rows = [min(step, self.rows - a) for a in self._starts]
        self._fd = os.open(self.path, os.O_RDONLY)  # closed by close(); pread needs no lock between threads

    @property
    def blocks(self) -> int:
        return len(self.block_rows)

    def block(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        a, n = self._starts[i], self.block_rows[i]
        index = self.index[a:a + n]
        x = np.empty((n, *self.row_shape), dtype=self.dtype)
        # One read per run of consecutive rows (a dealt share is runs of its batch size).
        cuts = np.concatenate([[0], np.flatnonzero(np.diff(index) != 1) + 1, [n]])
        for start, stop in zip(cuts[:-1], cuts[1:]):
            want = int(stop - start) * self.row_bytes
            got = os.preadv(self._fd, [memoryview(x[start:stop]).cast("B")],
                            self.offset + int(index[start]) * self.row_bytes)
            if got != want:
                raise OSError(f"{self.path} ended early: read {got} of {want} bytes")
        if x.dtype == np.float64:  # as the wire would have sent it: Keras trains in float32
            x = x.astype(np.float32)
        y = None if self.y is None else self.y[a:a + n]
        return x, y

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_rows(data_file: dict) -> np.ndarray:
    """A local worker's rows of one memory-mapped input (an ``NpyRows`` data file), read from the file into
    one array: an input among several, which the worker holds as it would hold them from the wire."""
    reader = NpyRows(data_file, None)
    try:
        out = np.empty((reader.rows, *reader.row_shape), dtype=np.float32 if reader.dtype == np.float64
                       else reader.dtype)
        at = 0
        for i in range(reader.blocks):
            block = reader.block(i)[0]
            out[at:at + len(block)] = block
            at += len(block)
        return out
    finally:
        reader.close()
