"""A keras.utils.PyDataset given to ``%dist_evaluate`` / ``nbdist.evaluate`` and ``%dist_predict`` /
``nbdist.predict`` (issue 24, one data path): what ``model.evaluate(ds)`` and ``model.predict(ds)`` return.

Each worker reads the batches rank, rank + N, ... in order, through the training path's reader
(worker/pydatasets.py); the driver sums the metric state and puts the predicted batches back in the
dataset's order. Real TF, real worker processes, digits.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest

import nbdist

from ..conftest import worker_processes

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

# Defined in a cell: the class lives in the notebook (__main__) and travels by value.
BATCHES_CELL = """
import keras, numpy as np
class Rows(keras.utils.PyDataset):
    '''Batches between `edges` of (x,), (x, y) or (x, y, w); x a dict when `names` are given.'''
    def __init__(self, x, y=None, w=None, edges=(), names=None, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.w, self.edges, self.names = x, y, w, list(edges), names
    def __len__(self):
        return len(self.edges) - 1
    def __getitem__(self, i):
        s = slice(self.edges[i], self.edges[i + 1])
        x = {n: self.x[s, k * 32:(k + 1) * 32] for k, n in enumerate(self.names)} if self.names else self.x[s]
        parts = (x,) + tuple(p[s] for p in (self.y, self.w) if p is not None)
        return parts if len(parts) > 1 else x
"""
# 301 rows in 8 batches of uneven sizes: worker 0 reads batches 0, 2, 4, 6 and worker 1 batches 1, 3, 5, 7.
EDGES = [0, 40, 77, 120, 160, 201, 240, 290, 301]


def test_evaluate_and_predict_on_a_py_dataset_equal_keras_on_it(ip, digits):
    """A binary classifier with AUC, batches of (x, y, sample_weight) of uneven sizes, 2 workers: the merged
    metrics equal ``model.evaluate(ds)`` to 1e-6 (AUC's thresholded counts summed, not averaged) and the
    predictions equal ``model.predict(ds)`` row for row, in the dataset's order."""
    x, y = digits
    ip.run_cell(BATCHES_CELL)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile("adam", "binary_crossentropy", metrics=["accuracy", keras.metrics.AUC(name="auc")])
    labels = (y >= 5).astype("float32")
    model.fit(x[:600], labels[:600], epochs=1, batch_size=32, verbose=0)
    w = np.random.default_rng(0).uniform(0.2, 3.0, 301).astype("float32")
    ds = ip.user_ns["Rows"](x[900:1201], labels[900:1201], w, EDGES)
    want = model.evaluate(ds, verbose=0, return_dict=True)
    got = nbdist.evaluate(model, ds, workers=2)
    assert got["samples"] == 301 and set(want) <= set(got)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    local = model.predict(ds, verbose=0)
    remote = nbdist.predict(model, ds, workers=2)
    assert remote.shape == local.shape == (301, 1)
    np.testing.assert_allclose(remote, local, rtol=0, atol=1e-6)


def test_dict_inputs_x_only_batches_and_fewer_batches_than_workers_through_the_magics(ip, digits):
    """A two-input model fed dicts: ``%dist_predict`` on x-only batches (5 of them over 2 workers) returns
    ``model.predict(ds)``'s rows in order; ``%dist_evaluate`` on a PyDataset of one batch of (x, y) over 2
    workers (one worker reads nothing) returns ``model.evaluate(ds)``."""
    x, y = digits
    ip.run_cell(BATCHES_CELL)
    keras.utils.set_random_seed(2)
    left, right = keras.Input((32,), name="left"), keras.Input((32,), name="right")
    out = keras.layers.Dense(10, activation="softmax")(keras.layers.Concatenate()([left, right]))
    model = keras.Model({"left": left, "right": right}, out)
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit({"left": x[:600, :32], "right": x[:600, 32:]}, y[:600], epochs=1, verbose=0)
    ns = ip.user_ns
    names = ["left", "right"]
    ns.update(m=model, xs=ns["Rows"](x[:250], edges=[0, 64, 128, 150, 200, 250], names=names),
              one=ns["Rows"](x[300:400], y[300:400], edges=[0, 100], names=names))
    ip.run_line_magic("dist_predict", "m --data xs --workers 2 --out pd")
    np.testing.assert_allclose(ns["pd"], model.predict(ns["xs"], verbose=0), rtol=0, atol=1e-6)
    ip.run_line_magic("dist_evaluate", "m --data one --workers 2 --out ev")
    want = model.evaluate(ns["one"], verbose=0, return_dict=True)
    assert ns["ev"]["samples"] == 100
    for name, value in want.items():
        assert ns["ev"][name] == pytest.approx(value, rel=1e-6, abs=1e-6), name
    assert not worker_processes()
