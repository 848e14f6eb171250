"""A generator as fit's validation_data (nbdist/data/pipelines.py generator_validation): the batches each
validation reads are the ones Keras' own generator adapter gives every pass (it replays the batches it peeked
at, then reads on), alike passes dealt as a PyDataset's, the rest one sentence."""
from __future__ import annotations

import itertools
import pickle

import numpy as np
import pytest

from nbdist.data.pipelines import generator_validation, validations
from nbdist.errors import NbdistError
from nbdist.fit_arguments import FitCall


def batches(n: int | None = None):
    """Batch k: 3 rows whose label is k (forever when ``n`` is None)."""
    for k in itertools.count() if n is None else range(n):
        yield np.full((3, 2), k, "float32"), np.full(3, k, "int64")


def keras_passes(n: int | None, steps: int | None, passes: int) -> list[list[int]]:
    """The labels of the batches Keras reads at each validation: its adapter's iterator made anew per pass (as
    evaluate makes it on JAX and torch), ``steps`` batches of it or all."""
    from keras.src.trainers.data_adapters.generator_data_adapter import GeneratorDataAdapter

    adapter = GeneratorDataAdapter(batches(n))
    return [[int(b[1][0]) for b in itertools.islice(adapter.get_numpy_iterator(), steps)] for _ in range(passes)]


def our_passes(n: int | None, steps: int | None, epochs: int, freq: int = 1) -> list[list[int]]:
    fit = FitCall(x=None, epochs=epochs, initial_epoch=0, validation_data=batches(n), validation_steps=steps,
                  validation_freq=freq)
    data = generator_validation(fit)
    dataset = pickle.loads(data.payload)
    out = []
    for _ in range(validations(fit)):
        out.append([int(dataset[i][1][0]) for i in range(len(dataset))])
        dataset.on_epoch_end()
    return out


@pytest.mark.parametrize("n, steps, epochs", [(None, 1, 3), (None, 2, 3), (None, 3, 4), (None, 6, 3), (9, 3, 3),
                                              (4, None, 1), (2, None, 3), (1, None, 3), (5, 5, 1)])
def test_each_validation_reads_what_keras_reads(n, steps, epochs):
    assert our_passes(n, steps, epochs) == keras_passes(n, steps, epochs)


def test_only_the_epochs_that_validate_draw_batches():
    fit = FitCall(x=None, epochs=7, initial_epoch=1, validation_freq=3)
    assert validations(fit) == 2  # epochs 2 and 5 (0-based), as Keras' (epoch + 1) % freq
    assert our_passes(None, 3, 6, freq=2) == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]


@pytest.mark.parametrize("n, steps, epochs, words", [
    (5, None, 2, "batches per validation: 5, 2"),  # Keras' second validation: the 2 peeked only
    (6, 4, 3, "batches per validation: 4, 4, 2"),
    (0, 3, 1, "yields no batches"),
])
def test_passes_that_differ_are_one_sentence(n, steps, epochs, words):
    fit = FitCall(x=None, epochs=epochs, initial_epoch=0, validation_data=batches(n), validation_steps=steps)
    with pytest.raises(NbdistError) as info:
        generator_validation(fit)
    assert words in str(info.value) and str(info.value).count(". ") == 0
