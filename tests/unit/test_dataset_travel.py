"""A PyDataset as it travels to the workers and as each worker's copy starts its epochs.

Keras' image iterators (``ImageDataGenerator().flow(...)``, ``flow_from_directory``) hold a lock and an unstarted
generator: both are made anew on arrival. Every worker calls its own copy's ``on_epoch_end``: one that shuffles
with the global generators (``np.random.shuffle(self.indexes)``, the image iterators' ``index_array``) must shuffle
alike everywhere, or the workers' batches would overlap.
"""
from __future__ import annotations

import pickle
import random
import threading

import keras
import numpy as np
import pytest

from nbdist.data.inputs import dump_dataset, make_py_dataset_data
from nbdist.data.sharding import epoch_hook
from nbdist.errors import NbdistError


def image_iterator(shuffle: bool = True):
    from keras.src.legacy.preprocessing.image import ImageDataGenerator  # tf.keras.preprocessing.image's

    x = np.arange(40 * 4, dtype="float32").reshape(40, 2, 2, 1)
    return ImageDataGenerator(horizontal_flip=True).flow(x, np.arange(40), batch_size=8, shuffle=shuffle)


class RowShuffler(keras.utils.PyDataset):
    """The classic Sequence: its row order reshuffled at every epoch's end, with numpy's global generator."""

    def __init__(self, rows: int, batch: int) -> None:
        super().__init__()
        self.rows, self.batch = np.arange(rows), batch
        self.lock = threading.RLock()
        self.orders = self._orders()  # an unstarted generator, made by a method

    def _orders(self, start=0):
        while True:
            yield start
            start += 1

    def __len__(self) -> int:
        return -(-len(self.rows) // self.batch)

    def __getitem__(self, i: int):
        ids = self.rows[i * self.batch:(i + 1) * self.batch]
        return ids[:, None].astype("float32"), ids

    def on_epoch_end(self) -> None:
        np.random.shuffle(self.rows)


def test_an_image_iterator_travels_with_a_new_lock_and_index_generator():
    it = image_iterator()
    with pytest.raises(TypeError, match="pickle"):
        pickle.dumps(it)
    data = make_py_dataset_data(it, "training data")
    copy = pickle.loads(data.payload)
    assert type(copy.lock) is type(threading.Lock()) and copy.lock is not it.lock and copy.lock.acquire(False)
    assert len(next(copy.index_generator)) == 8  # its own generator, over its own index array
    assert copy.n == 40 and len(copy) == 5


def test_a_started_generator_still_cannot_travel():
    ds = RowShuffler(10, 4)
    copy = pickle.loads(dump_dataset(ds))
    assert next(copy.orders) == 0 and copy.lock.acquire(False)
    next(ds.orders)  # started: where it stands cannot be made anew
    with pytest.raises(NbdistError, match="cannot be sent to the workers"):
        make_py_dataset_data(ds, "training data")


@pytest.mark.parametrize("make", [lambda: RowShuffler(40, 8), image_iterator], ids=["sequence", "image-iterator"])
def test_every_copy_shuffles_alike_at_an_epoch_end_and_keeps_its_own_draws(make):
    payload = dump_dataset(make())
    copies = [pickle.loads(payload) for _ in range(2)]
    for epoch in range(3):
        drawn = []
        for rank, copy in enumerate(copies):  # each worker's generators stand elsewhere
            np.random.seed(100 + rank)
            random.seed(100 + rank)
            epoch_hook(copy.on_epoch_end, seed=7, epoch=epoch)
            drawn.append((np.random.randint(1 << 30), random.random()))  # its own stream, as before the hook
        rows = [np.concatenate([copy[i][1] for i in range(len(copy))]) for copy in copies]
        np.testing.assert_array_equal(rows[0], rows[1])
        assert sorted(rows[0]) == list(range(40))
        assert drawn[0] != drawn[1]
        np.random.seed(100)
        random.seed(100)
        assert drawn[0] == (np.random.randint(1 << 30), random.random())
    unseeded = [pickle.loads(payload) for _ in range(2)]
    for rank, copy in enumerate(unseeded):
        np.random.seed(100 + rank)
        copy.on_epoch_end()
    assert not np.array_equal(*[np.concatenate([c[i][1] for i in range(len(c))]) for c in unseeded])
