"""A torch ``DataLoader`` over a map-style ``Dataset`` (``__getitem__`` reading lazily), split by index over the
workers: it travels as a PyDataset (worker/pydatasets.py) whose item ``i`` is worker ``i % world``'s part of
the loader's batch ``i // world``: that batch's rows dealt as nbdist deals a global batch (sizes differing by
at most one, larger first), collated by the loader's ``collate_fn`` from ``dataset[k]``. Read strided, one
step of all workers is one step of the loader: the fit's global batch is the loader's ``batch_size``. The
epoch's rows are in order (SequentialSampler) or a permutation drawn from (seed, epoch), the same on every
worker (RandomSampler); ``drop_last`` drops the epoch's last short batch. A last batch of fewer rows than
workers leaves some workers without a part: they pad that step with no rows.
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np


def _numpy(value: Any) -> Any:
    """A collated batch with its torch tensors as numpy arrays (tuples, lists and dicts kept)."""
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return (list if isinstance(value, list) else tuple)(_numpy(v) for v in value)
    return value.detach().cpu().numpy() if hasattr(value, "detach") else value


class LoaderShares(keras.utils.PyDataset):
    """The loader's batches, each cut into ``world`` parts (see the module's docstring)."""

    def __init__(self, loader: Any, world: int, seed: int, shuffle: bool, first_epoch: int) -> None:
        super().__init__()
        self.dataset, self.collate_fn = loader.dataset, loader.collate_fn
        self.batch, self.world, self.seed, self.shuffle = int(loader.batch_size), int(world), int(seed), shuffle
        total = len(loader.dataset)
        self.total = total
        self.rows = total - total % self.batch if loader.drop_last else total  # rows an epoch reads
        self.first_epoch = self.epoch = int(first_epoch)
        self._began = False
        self._order: np.ndarray | None = None

    def __len__(self) -> int:
        full, rest = divmod(self.rows, self.batch)
        return full * self.world + min(rest, self.world)

    def on_epoch_begin(self) -> None:
        if self._began:  # the first call begins first_epoch
            self.epoch += 1
        self._began, self._order = True, None

    def order(self) -> np.ndarray:
        """The epoch's row order, the same on every worker."""
        if self._order is None:
            self._order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.total) if self.shuffle
                           else np.arange(self.total))
        return self._order

    def __getitem__(self, index: int) -> Any:
        batch, part = divmod(int(index), self.world)
        start = batch * self.batch
        rows = np.array_split(np.arange(start, min(start + self.batch, self.rows)), self.world)[part]
        return _numpy(self.collate_fn([self.dataset[int(k)] for k in self.order()[rows]]))
