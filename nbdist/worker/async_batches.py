"""Where an async worker's batches come from (``--strategy async``, async_fit.py): the driver deals batch
indices, never rows, so every block's message is a few integers whatever the data.

- A PyDataset: batch i is the dataset's own ``__getitem__(i)``.
- In-memory arrays: every worker holds all of them (from the job, or a local worker's memory map of the
  notebook's .npy), and batch i of an epoch is rows ``order[i*u:(i+1)*u]`` of them, ``order`` the epoch's
  row order (shuffled by the run's seed and the epoch, the same on every worker) and ``u`` one worker's
  share of fit's global batch: the epoch's rows cut as Keras' fit cuts them, into smaller batches.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..data.inputs import standardize_batch
from ..data.ragged import is_ragged
from ..data.sharding import epoch_hook, epoch_order
from ..data.structures import leaves, map_struct
from ..wire.messages import JobMessage


class PyDatasetBatches:
    def __init__(self, dataset: Any, class_weight: dict[int, float] | None, seed: int) -> None:
        self.dataset, self.class_weight, self.seed = dataset, class_weight, seed
        self._epoch = 0

    def __len__(self) -> int:
        return len(self.dataset)

    def on_epoch_begin(self, epoch: int) -> None:
        self._epoch = epoch
        epoch_hook(self.dataset.on_epoch_begin, self.seed, epoch)  # batch i alike on every worker

    def on_epoch_end(self) -> None:
        epoch_hook(self.dataset.on_epoch_end, self.seed, self._epoch)

    def batch(self, i: int) -> tuple[Any, ...]:
        return standardize_batch(self.dataset[i], self.class_weight)


class ArrayBatches:
    """Batches of ``unit`` rows of arrays every worker holds whole, in the epoch's row order."""

    def __init__(self, x: Any, y: Any, sample_weight: Any, unit: int, shuffle: bool, seed: int) -> None:
        parts = (x, y, sample_weight)
        self.parts = parts[:3 if sample_weight is not None else 2 if y is not None else 1]  # as a PyDataset's items
        self.rows = int(leaves(x)[0].shape[0])
        self.unit, self.shuffle, self.seed = int(unit), bool(shuffle), int(seed)
        self._order = np.arange(self.rows, dtype=np.int64)

    def __len__(self) -> int:
        return -(-self.rows // self.unit)

    def on_epoch_begin(self, epoch: int) -> None:
        # Not the driver's batch-order stream (seed, epoch): the rows get their own (seed + 1, epoch).
        self._order = epoch_order(self.rows, self.shuffle, self.seed + 1, epoch)

    def on_epoch_end(self) -> None:
        pass

    def batch(self, i: int) -> tuple[Any, ...]:
        rows = self._order[i * self.unit:(i + 1) * self.unit]
        return tuple(map_struct(lambda a: _rows(a, rows), part) for part in self.parts)


def _rows(a: Any, rows: np.ndarray) -> Any:
    if is_ragged(a):  # a tf.RaggedTensor (data/ragged.py): its rows as tf.gather takes them
        import tensorflow as tf

        return tf.gather(a, rows)
    out = np.asarray(a[rows])
    return out.astype(np.float32) if out.dtype == np.float64 else out  # a memory map's rows: as the wire sends them


def file_array(data_file: dict[str, Any]) -> np.ndarray:
    """The notebook's memory-mapped .npy as a local worker maps it (read-only; pages read as batches need them)."""
    return np.memmap(str(data_file["path"]), dtype=np.dtype(data_file["dtype"]), mode="r",
                     offset=int(data_file["offset"]), shape=tuple(int(s) for s in data_file["shape"]))


def job_batches(job: JobMessage) -> PyDatasetBatches | ArrayBatches:
    """This worker's batch source for the job's training data."""
    if job.py_datasets is not None:
        import cloudpickle  # the job came over the authenticated channel

        source = cloudpickle.loads(job.py_datasets)["train"]
        return PyDatasetBatches(cloudpickle.loads(source.payload), source.class_weight, int(job.train.seed or 0))
    from .datasets import rank_batch_size

    x = file_array(job.data_file) if job.data_source == "file" else job.x
    batches = ArrayBatches(x, job.y, job.sample_weight, rank_batch_size(job), bool(job.train.shuffle),
                           int(job.train.seed or 0))
    job.x = job.y = job.sample_weight = None  # held by the batch source now
    return batches
