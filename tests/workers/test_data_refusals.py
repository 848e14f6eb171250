"""Every entry point refuses a stream (a generator, a DataLoader) and a tf.data pipeline it cannot read soundly
with the same one sentence, before any worker starts."""
from __future__ import annotations

import keras
import numpy as np
import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist.errors import NbdistError

from ..conftest import mlp, worker_processes

STREAMS = {
    "generator": (lambda: (row for row in np.zeros((8, 64), "float32")), "is a generator or iterator",
                  "pass the arrays it reads from"),
}
try:  # the JAX/torch extra: a torch DataLoader over an iterable dataset is refused as the other streams
    import torch.utils.data

    class _Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(np.zeros((8, 64), "float32"))

    # Over a TensorDataset it is read once into arrays (test_pipelines.py); over another map-style dataset
    # it is split by index for training (test_backends.py); over an iterable one it is neither.
    STREAMS["torch DataLoader"] = (lambda: torch.utils.data.DataLoader(_Stream(), batch_size=4),
                                   "over an IterableDataset (_Stream)", "cannot be split over the workers by index")
except ImportError:
    pass
CELL = ("model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation='softmax')])\n"
        "model.compile('sgd', 'sparse_categorical_crossentropy')\n")


def _train_api(ip, x):
    nbdist.train(mlp(), x, ip.user_ns["y"][:8], workers=2)


def _magic_data(ip, x):
    ip.user_ns["S"] = x
    ip.run_cell_magic("dist_train", "--data S,y --workers 2 --ui none", CELL)


def _cell_fit(ip, x):
    ip.user_ns["S"] = x
    ip.run_cell_magic("dist_train", "--workers 2 --ui none", CELL + "model.fit(S, y[:8])\n")


def _evaluate(ip, x):
    ip.user_ns.update(S=x, m=mlp())
    ip.run_line_magic("dist_evaluate", "m --data S,y --workers 2")


def _predict(ip, x):
    ip.user_ns.update(S=x, m=mlp())
    ip.run_line_magic("dist_predict", "m --data S --workers 2")


def _rows():
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((np.zeros((8, 64), "float32"), np.zeros(8, "int64")))


# A finite, batched tf.data pipeline is read into arrays (test_tf_data.py); these three are not.
STREAMS.update({
    "tf.data repeating forever": (lambda: _rows().batch(4).repeat(), "repeats forever (.repeat())", "tf.data pipeline"),
    "tf.data drawing random numbers": (
        lambda: _rows().map(lambda x, y: (x + __import__("tensorflow").random.uniform((64,)), y)).batch(4),
        "draws random numbers (RandomUniform", "tf.data pipeline"),
    "tf.data not batched": (_rows, "without .batch(...)", "tf.data pipeline"),
})


ENTRIES = {"nbdist.train": _train_api, "--data": _magic_data, "model.fit": _cell_fit, "%dist_evaluate": _evaluate,
           "%dist_predict": _predict}
# A generator as fit's x is read for the batches Keras would draw (test_same_step.py; its refusals below).
READ_BY_FIT = {("generator", "nbdist.train"), ("generator", "model.fit")}


@pytest.mark.parametrize("entry, kind", [pytest.param(ENTRIES[e], k, id=f"{k}-{e}") for k in sorted(STREAMS)
                                         for e in ENTRIES if (k, e) not in READ_BY_FIT])
def test_a_stream_is_one_sentence_at_every_entry_point(ip, entry, kind):
    make, words, also = STREAMS[kind]
    ip.user_ns["keras"] = keras
    with pytest.raises((NbdistError, UsageError)) as info:
        entry(ip, make())
    message = str(info.value)
    assert words in message and also in message, message
    assert "dtype object" not in message and "\n" not in message
    assert not worker_processes()


def _batches(*rows, labels=True):
    return ((np.zeros((n, 64), "float32"), np.zeros(n, "int64")) if labels else np.zeros((n, 64), "float32")
            for n in rows)


@pytest.mark.parametrize("fit, words", [
    ("model.fit(_batches(4, 4), y[:8])", "got a generator as x and y too; drop y"),
    ("model.fit(_batches(4, 4, labels=False))", "whose batches hold no labels"),
    ("model.fit(_batches(4, 3, 4))", "whose batches have 4 rows and 3; "),
    ("model.fit(_batches(4, 4), epochs=2)", "ended after 2 batches, which leaves the second of epochs=2"),
    ("model.fit(_batches(4, 4), steps_per_epoch=2, epochs=2)", "ended after 2 batches, but steps_per_epoch=2 over "
                                                               "2 epochs draws 4"),
    ("%%--batch-size 2\nmodel.fit(_batches(4, 4))", "a generator makes its own batches: drop --batch-size"),
    ("model.fit(X[:8], y[:8], epochs=2, validation_data=_batches(4, 4, 4))",
     "validation_data is a generator that ends, so Keras would validate on fewer batches from some epoch on "
     "(batches per validation: 3, 2;"),
], ids=["and-y", "no-labels", "uneven", "finite-epochs", "too-short", "batch-size", "validation"])
def test_a_generator_keras_could_not_draw_the_fit_from_is_one_sentence(ip, fit, words):
    """model.fit(generator): what reading it for the fit's batches cannot keep is said in one sentence, before any
    worker starts (a batch of other rows would not be split over the workers as one global batch)."""
    ip.user_ns.update(keras=keras, _batches=_batches, G=_batches(4, 4))
    line = "--workers 2 --ui none"
    if fit.startswith("%%"):  # options for the magic line, then the fit
        more, fit = fit[2:].split("\n", 1)
        line += " " + more
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("dist_train", line, CELL + fit + "\n")
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not worker_processes()
    assert len(list(ip.user_ns["G"])) == 2  # the notebook's generator G was not drawn from


class _Batches(keras.utils.PyDataset):
    """Two batches of (x, y) of 4 digits-sized rows, or x alone (``labels=False``), ``width`` features wide."""

    def __init__(self, labels: bool = True, width: int = 64) -> None:
        super().__init__()
        self.labels, self.width = labels, width

    def __len__(self):
        return 2

    def __getitem__(self, i):
        x = np.zeros((4, self.width), "float32")
        return (x, np.zeros(4, "int64")) if self.labels else x


def _evaluate_weighted(ip, x):
    nbdist.evaluate(mlp(), x, sample_weight=np.ones(8, "float32"), workers=2)


# Evaluation and prediction take a PyDataset as model.evaluate / model.predict do (test_inference_pydataset.py);
# what those refuse beside one is refused in one sentence, before any worker starts.
PY_DATASET_REFUSALS = {
    "y beside it": (_evaluate, _Batches(), "was given too; drop y"),
    "sample_weight beside it": (_evaluate_weighted, _Batches(), "was given too; drop sample_weight"),
    "no labels to evaluate": (lambda ip, x: nbdist.evaluate(mlp(), x, workers=2), _Batches(labels=False),
                              "whose batches hold no labels"),
    "features of another width": (_predict, _Batches(width=32), "features of shape (32,) per row"),
}


@pytest.mark.parametrize("case", sorted(PY_DATASET_REFUSALS))
def test_what_keras_refuses_beside_a_py_dataset_is_one_sentence(ip, case):
    entry, dataset, words = PY_DATASET_REFUSALS[case]
    with pytest.raises((NbdistError, UsageError)) as info:
        entry(ip, dataset)
    message = str(info.value)
    assert words in message and "\n" not in message, message
    assert not worker_processes()
