"""The shard file: how a Spark task hands its partition to the worker it starts on the same executor.

The task streams rows into ``x.npy`` (and ``y.npy``) in a directory it names in ``NBDIST_DATA_DIR``;
the worker loads them. Plain .npy files, never pickles.
"""
from __future__ import annotations

import os
import struct
from collections.abc import Sequence

import numpy as np

DATA_ENV = "NBDIST_DATA_DIR"  # tells the worker where its task wrote the shard
X_FILE, Y_FILE = "x.npy", "y.npy"
NPY_HEADER_SIZE = 128  # fixed, so the shape can be written after streaming the rows


def npy_header(dtype: np.dtype, shape: Sequence[int], size: int = NPY_HEADER_SIZE) -> bytes:
    """A version 1.0 .npy header padded to exactly ``size`` bytes (a multiple of 64)."""
    descr = np.lib.format.dtype_to_descr(np.dtype(dtype))
    text = repr({"descr": descr, "fortran_order": False, "shape": tuple(int(s) for s in shape)}).encode("latin1")
    room = size - 10  # magic (6) + version (2) + length (2)
    if len(text) + 1 > room:
        raise ValueError(f"shape {tuple(shape)} does not fit a {size}-byte npy header")
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", room) + text + b" " * (room - len(text) - 1) + b"\n"


class NpyStreamWriter:
    """Append row blocks to a .npy file without holding the whole partition in memory."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "wb")  # noqa: SIM115 - appended to across calls, closed by close()
        self._f.write(b"\0" * NPY_HEADER_SIZE)
        self.dtype: np.dtype | None = None
        self.row_shape: tuple[int, ...] | None = None
        self.rows = 0

    def append(self, block: np.ndarray, what: str) -> None:
        if self.dtype is None:
            self.dtype, self.row_shape = block.dtype, block.shape[1:]
        elif block.shape[1:] != self.row_shape:
            raise ValueError(f"{what} has {block.shape[1:]} values in some rows but {self.row_shape} in others; "
                             "every row needs the same number of values.")
        self._f.write(np.ascontiguousarray(block, dtype=self.dtype).tobytes())
        self.rows += len(block)

    def close(self) -> None:
        self._f.seek(0)
        self._f.write(npy_header(self.dtype or np.float32, (self.rows, *(self.row_shape or ()))))
        self._f.close()


def load_task_data(directory: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """The worker's side: read what its task wrote."""
    directory = directory or os.environ.get(DATA_ENV)
    if not directory:
        raise RuntimeError(f"the job says the data is local but {DATA_ENV} is not set")
    x = np.load(os.path.join(directory, X_FILE))
    y_path = os.path.join(directory, Y_FILE)
    y = np.load(y_path) if os.path.exists(y_path) else None
    return x, y
