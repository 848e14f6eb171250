"""Ragged rows: a ``tf.RaggedTensor`` as the plain numpy arrays it is made of, so it splits and travels as
arrays do (pure numpy; no TensorFlow object is ever pickled).

``RaggedRows`` holds the flat values and the nested row splits (outermost first). It has rows as an array
has: ``len``, and ``rows[slice]`` / ``rows[indices]`` gather whole rows (``sharding.deal_rows``' indices,
``validation_split``'s slices), ``concat`` joins several in order (a prediction's shards). On the wire it
is its arrays (``structures.flatten``); where Keras takes it (a TensorFlow worker's ``fit``, the driver's
copy of the model) ``model.tensors.keras_data`` makes the ``tf.RaggedTensor`` again.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


def is_ragged(value: Any) -> bool:
    """A ``tf.RaggedTensor`` (told by its class, so this module needs no TensorFlow)."""
    return type(value).__name__ == "RaggedTensor" and type(value).__module__.startswith("tensorflow")


@dataclass(frozen=True, eq=False)
class RaggedRows:
    """Rows of different lengths: ``values`` (the flat values) cut by ``splits`` (one row-splits vector
    per ragged dimension, outermost first, each starting at 0 and ending at the next one's length)."""

    values: np.ndarray
    splits: tuple[np.ndarray, ...]

    def __len__(self) -> int:
        return len(self.splits[0]) - 1

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    @property
    def shape(self) -> tuple[int | None, ...]:
        """As TensorFlow gives a ragged tensor's: the rows, None per ragged dimension, then the values' own."""
        return (len(self), *(None,) * len(self.splits), *self.values.shape[1:])

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes + sum(s.nbytes for s in self.splits))

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("ragged rows are no one numpy array; take their values and splits (components())")

    def components(self) -> list[np.ndarray]:
        """What crosses the wire: the values, then the splits (``from_components`` reverses it)."""
        return [self.values, *self.splits]

    @classmethod
    def from_components(cls, arrays: Sequence[np.ndarray]) -> RaggedRows:
        return cls(arrays[0], tuple(arrays[1:]))

    def __getitem__(self, index: slice | np.ndarray | Sequence[int]) -> RaggedRows:
        """The rows ``index`` picks (a slice or row indices), in that order, as ``tf.gather`` takes them."""
        rows = np.arange(len(self), dtype=np.int64)[index] if isinstance(index, slice) else \
            np.asarray(index, dtype=np.int64).reshape(-1)
        splits = []
        for s in self.splits:  # each level: the picked rows' spans, then the positions within them
            starts, stops = s[rows], s[rows + 1]
            lengths = stops - starts
            new = np.zeros(len(rows) + 1, dtype=s.dtype)
            np.cumsum(lengths, out=new[1:])
            splits.append(new)
            rows = np.arange(int(new[-1]), dtype=np.int64) + np.repeat(starts - new[:-1], lengths)
        return RaggedRows(self.values[rows], tuple(splits))


def ragged_rows(value: Any) -> RaggedRows:
    """A ``tf.RaggedTensor``'s numpy components (its flat values, its nested row splits)."""
    splits = tuple(np.asarray(s.numpy()) for s in value.nested_row_splits)
    return RaggedRows(np.asarray(value.flat_values.numpy()), splits)


def concat(parts: Sequence[RaggedRows]) -> RaggedRows:
    """The rows of ``parts`` one after another (each level's splits shifted by what came before)."""
    levels = len(parts[0].splits)
    if any(len(p.splits) != levels for p in parts):
        raise ValueError("ragged rows of different ragged ranks cannot be joined")
    splits = []
    for level in range(levels):
        pieces, offset = [np.zeros(1, dtype=parts[0].splits[level].dtype)], 0
        for p in parts:
            s = p.splits[level]
            pieces.append(s[1:] - s[0] + offset)
            offset += int(s[-1] - s[0])
        splits.append(np.concatenate(pieces))
    return RaggedRows(np.concatenate([p.values for p in parts], axis=0), tuple(splits))
