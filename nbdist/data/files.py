"""Data on disk: memory-mapped ``.npy`` files read by row, and what does not fit in memory (one sentence)."""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any

import numpy as np

from .sharding import dealt_rows


@dataclass(frozen=True)
class NpyFile:
    """Where a memory-mapped array's rows lie: a whole .npy file (``np.load(path, mmap_mode="r")``)."""

    path: str
    offset: int  # bytes of header before the first row
    dtype: str
    shape: tuple[int, ...]

    def rows(self, start: int, stop: int) -> dict[str, Any]:
        """What a local worker's job says about its rows ``start:stop`` of this file."""
        return {**self._where(), "start": int(start), "stop": int(stop)}

    def dealt(self, global_batch: int, world: int, rank: int) -> dict[str, Any]:
        """What a local worker's job says about its dealt rows of this file (``dealt_rows``)."""
        return {**self._where(), "deal": [int(self.shape[0]), int(global_batch), int(world), int(rank)]}

    def _where(self) -> dict[str, Any]:
        return {"path": self.path, "offset": self.offset, "dtype": self.dtype, "shape": list(self.shape)}


def file_index(data_file: dict[str, Any]) -> np.ndarray:
    """The rows of the file a job's ``data_file`` names, in the order the worker reads them."""
    if "deal" in data_file:
        return dealt_rows(*(int(v) for v in data_file["deal"]))
    return np.arange(int(data_file["start"]), int(data_file["stop"]), dtype=np.int64)


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


# The most an input read whole into the notebook (a tf.data pipeline, a sparse matrix made dense) may take:
# a quarter of the memory available, at most this.
MAX_READ_BYTES = 8 * 2**30


def memory_budget() -> int:
    try:
        import psutil

        return min(MAX_READ_BYTES, psutil.virtual_memory().available // 4)
    except Exception:  # no psutil: the fixed bound
        return MAX_READ_BYTES
