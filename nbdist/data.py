"""Turn the notebook's training data into per-worker shards (pure numpy logic)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import NbdistError


@dataclass(frozen=True)
class Dataset:
    """Features and labels as numpy arrays of equal length."""

    x: np.ndarray
    y: np.ndarray | None

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def slice(self, start: int, stop: int) -> Dataset:
        return Dataset(self.x[start:stop], None if self.y is None else self.y[start:stop])


def as_array(value: Any, what: str) -> np.ndarray:
    """numpy arrays, pandas objects and nested lists as one array, or one sentence."""
    if hasattr(value, "to_numpy") and callable(value.to_numpy):  # pandas DataFrame / Series
        value = value.to_numpy()
    try:
        return np.asarray(value)
    except Exception as exc:  # ragged lists and the like
        raise NbdistError(f"{what} cannot be turned into an array ({exc}); pass a numpy array.") from None


def to_array(value: Any, what: str) -> np.ndarray:
    """Accept numpy arrays, pandas objects and nested lists; reject what cannot train."""
    arr = as_array(value, what)
    if arr.dtype.kind not in "biuf":
        if arr.dtype.kind == "b":
            arr = arr.astype("float32")
        else:
            raise NbdistError(
                f"{what} has dtype {arr.dtype}, not numbers; convert it first, e.g. {what}.astype('float32')."
            )
    if arr.ndim == 0:
        raise NbdistError(f"{what} is a single value, not a dataset; pass one row per example.")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
        raise NbdistError(f"{what} holds {bad} NaN or infinite values; clean or impute them before training.")
    return arr


def make_dataset(x: Any, y: Any, what: str = "data") -> Dataset:
    xa = to_array(x, f"{what} features")
    ya = None if y is None else to_array(y, f"{what} labels")
    if ya is not None and len(ya) != len(xa):
        raise NbdistError(
            f"{what}: features have {len(xa)} rows but labels have {len(ya)}; pass X and y of the same length."
        )
    if len(xa) == 0:
        raise NbdistError(f"{what} is empty; pass at least one example per worker.")
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
