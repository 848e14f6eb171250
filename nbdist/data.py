"""Turn the notebook's training data into per-worker shards (pure numpy logic)."""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import NbdistError


@dataclass(frozen=True)
class NpyFile:
    """Where a memory-mapped array's rows lie: a whole .npy file (``np.load(path, mmap_mode="r")``)."""

    path: str
    offset: int  # bytes of header before the first row
    dtype: str
    shape: tuple[int, ...]

    def rows(self, start: int, stop: int) -> dict[str, Any]:
        """What a local worker's job says about its rows ``start:stop`` of this file."""
        return {"path": self.path, "offset": self.offset, "dtype": self.dtype, "shape": list(self.shape),
                "start": int(start), "stop": int(stop)}


def npy_file(arr: Any) -> NpyFile | None:
    """The .npy file a memory map reads in whole (as ``np.load(..., mmap_mode=...)`` returns it), else None.

    A slice or other view of such an array is not taken: its rows are not the file's rows.
    """
    if not isinstance(arr, np.memmap) or not getattr(arr, "filename", None) or not isinstance(arr.base, mmap.mmap):
        return None
    if not arr.flags.c_contiguous or arr.ndim < 1 or arr.dtype.hasobject:
        return None
    try:
        with open(arr.filename, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            offset = f.tell()
    except (OSError, ValueError):
        return None
    if fortran or tuple(shape) != arr.shape or np.dtype(dtype) != arr.dtype or arr.offset != offset:
        return None
    return NpyFile(str(arr.filename), int(offset), np.lib.format.dtype_to_descr(arr.dtype), tuple(arr.shape))


@dataclass(frozen=True)
class Dataset:
    """Features and labels as numpy arrays of equal length.

    ``x_file``: the features are the notebook's memory map of this .npy file; local workers read
    their rows from it (worker/streams.py) instead of receiving them.
    """

    x: np.ndarray
    y: np.ndarray | None
    x_file: NpyFile | None = None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def slice(self, start: int, stop: int) -> Dataset:
        return Dataset(self.x[start:stop], None if self.y is None else self.y[start:stop], self.x_file)


def not_in_memory(value: Any) -> str | None:
    """The kind of input pipeline ``value`` is, if it is one rather than in-memory data."""
    cls = type(value)
    names = {f"{c.__module__}.{c.__name__}" for c in cls.__mro__}
    if any(n.startswith("tensorflow.python.data") for n in names):
        return "a tf.data.Dataset"
    if any("torch.utils.data" in n for n in names):
        return "a torch DataLoader"
    if hasattr(value, "__next__") or (hasattr(value, "__iter__") and not isinstance(value, (list, tuple, dict))
                                      and not hasattr(value, "shape") and not hasattr(value, "to_numpy")):
        return "a generator or iterator"
    return None


def pipeline_message(kind: str, what: str) -> str:
    return (f"{what} is {kind}: nbdist splits in-memory data over the workers and cannot split a stream "
            f"soundly; pass the arrays it reads from (numpy arrays, pandas, or a dict or list of them) "
            f"to model.fit instead, e.g. model.fit(X, y, batch_size=32), or wrap them in a "
            f"keras.utils.PyDataset, whose batches nbdist deals to the workers.")


def as_array(value: Any, what: str) -> np.ndarray:
    """numpy arrays, pandas objects and nested lists as one array, or one sentence."""
    kind = not_in_memory(value)
    if kind is not None:  # every entry point refuses a stream with the same sentence
        raise NbdistError(pipeline_message(kind, what))
    if hasattr(value, "to_numpy") and callable(value.to_numpy):  # pandas DataFrame / Series
        value = value.to_numpy()
    try:
        return np.asarray(value)
    except Exception as exc:  # ragged lists and the like
        raise NbdistError(f"{what} cannot be turned into an array ({exc}); pass a numpy array.") from None


def as_text(arr: np.ndarray) -> np.ndarray | None:
    """Strings as Keras takes them (a ``StringLookup`` or ``TextVectorization`` input): numpy str or bytes
    arrays as they are, and object arrays (a list of str, a pandas string column) of only str, or only
    bytes, as fixed-width ones, which cross the wire as raw buffers. None for anything else."""
    if arr.dtype.kind in "US":
        return arr
    if arr.dtype != object or arr.size == 0:
        return None
    flat = arr.ravel()
    if all(isinstance(v, str) for v in flat):
        return arr.astype(str)
    if all(isinstance(v, bytes) for v in flat):
        return arr.astype(bytes)
    return None


def to_array(value: Any, what: str) -> np.ndarray:
    """Accept numpy arrays, pandas objects and nested lists; reject what cannot train."""
    arr = as_array(value, what)
    text = as_text(arr)
    if text is not None:
        if text.ndim == 0:
            raise NbdistError(f"{what} is a single value, not a dataset; pass one row per example.")
        return text
    if arr.dtype.kind not in "biuf":
        if arr.dtype.kind == "b":
            arr = arr.astype("float32")
        else:
            raise NbdistError(
                f"{what} has dtype {arr.dtype}, not numbers; convert it first, e.g. {what}.astype('float32')."
            )
    if arr.ndim == 0:
        raise NbdistError(f"{what} is a single value, not a dataset; pass one row per example.")
    if arr.dtype.kind == "f":
        bad = non_finite(value if npy_file(value) is not None else arr)
        if bad:
            raise NbdistError(f"{what} holds {bad} NaN or infinite values; clean or impute them before training.")
    return arr


def non_finite(arr: np.ndarray, block_bytes: int = 16 * 2**20) -> int:
    """NaN and infinite values in ``arr``, counted a block of rows at a time. A whole-file memory map
    is read with plain file reads: pages read through the map would stay in the notebook's RSS."""
    if arr.ndim == 0 or len(arr) == 0:
        return 0
    step = max(1, block_bytes // max(1, arr[:1].nbytes))
    source = npy_file(arr)
    if source is None:
        return sum(int(np.size(arr[i:i + step]) - np.count_nonzero(np.isfinite(arr[i:i + step])))
                   for i in range(0, len(arr), step))
    per_row = int(np.prod(arr.shape[1:], dtype=np.int64))
    bad = 0
    with open(source.path, "rb") as f:
        f.seek(source.offset)
        for i in range(0, len(arr), step):
            block = np.fromfile(f, dtype=arr.dtype, count=min(step, len(arr) - i) * per_row)
            bad += int(block.size - np.count_nonzero(np.isfinite(block)))
    return bad


def make_dataset(x: Any, y: Any, what: str = "data") -> Dataset:
    xa = to_array(x, f"{what} features")
    ya = None if y is None else to_array(y, f"{what} labels")
    if ya is not None and len(ya) != len(xa):
        raise NbdistError(
            f"{what}: features have {len(xa)} rows but labels have {len(ya)}; pass X and y of the same length."
        )
    if len(xa) == 0:
        raise NbdistError(f"{what} is empty; pass at least one example per worker.")
    source = npy_file(x)
    if source is not None:  # stays on disk: local workers read their rows (and cast them) themselves
        return Dataset(xa, ya, source)
    if xa.dtype == np.float64:  # Keras trains in float32; halve what crosses the wire
        xa = xa.astype(np.float32)
    return Dataset(xa, ya)


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """Split ``n`` rows into ``shards`` contiguous ranges whose sizes differ by at most one."""
    if shards < 1:
        raise ValueError("shards must be >= 1")
    base, extra = divmod(n, shards)
    bounds, start = [], 0
    for i in range(shards):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def check_workers(n: int, workers: int, what: str = "training data") -> None:
    if workers > n:
        raise NbdistError(
            f"{workers} workers but only {n} examples in the {what}; use --workers {max(1, n)} or fewer."
        )


def batches_per_epoch(samples: int, batch_size: int) -> int:
    return -(-samples // batch_size)
