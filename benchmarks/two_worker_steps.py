"""What the engine benchmarks share (tf_device_sum.py, torch_overlap.py, jax_engine.py): their arguments, a
seeded MLP, and ms per step of 2 local allreduce workers training it on generated rows, each configuration in
alternating rounds. Import it after the script has chosen its Keras backend (KERAS_BACKEND)."""
from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

import nbdist


def build(dim: int, hidden: list[int], lr: float = 1e-3) -> keras.Model:
    """Dense layers with seeded Glorot kernels, 10 softmax classes, Adam."""
    layers = [keras.Input((dim,))] + [keras.layers.Dense(h, activation="relu",
                                                         kernel_initializer=keras.initializers.GlorotUniform(i))
                                      for i, h in enumerate(hidden)]
    out = keras.layers.Dense(10, activation="softmax", kernel_initializer=keras.initializers.GlorotUniform(99))
    model = keras.Sequential(layers + [out])
    model.compile(keras.optimizers.Adam(lr), "sparse_categorical_crossentropy")
    return model


def two_workers(model: keras.Model, rows: int, epochs: int, batch: int, **options: Any) -> dict[str, Any]:
    """Train ``model`` on 2 local workers (``batch`` rows each per step) on ``rows`` generated rows, with
    nbdist.train's ``options`` (the engine's typed fields). Returns ms per step (epochs after the first), the
    slowest worker's sync ms per round, the weights and each worker's ``summed_by``."""
    dim = int(model.inputs[0].shape[-1])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(rows, dim)).astype("float32"), rng.integers(0, 10, rows)
    job = nbdist.train(model, x, y, workers=2, strategy="allreduce", epochs=epochs, batch_size=batch,
                       shuffle=False, lr_scaling="none", ui="none", **options)
    seconds = job.state.epoch_seconds[1:]
    reports = [job.reports[r] for r in range(2)]
    return {"ms_per_step": 1000 * sum(seconds) / len(seconds) / (rows // (2 * batch)),
            "sync_ms": max(1000 * r["sync_seconds"] / max(1, r["rounds"]) for r in reports),
            "weights": model.get_weights(), "summed_by": [str(r["summed_by"]) for r in reports]}


def arguments(epochs: int) -> argparse.Namespace:
    """--epochs (the first is not timed), --rounds (of every configuration, alternating), --batch."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=epochs)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="rows per worker per step")
    parser.add_argument("--bucket-mib", type=float, default=25, help="the device sum's buckets (bucket_bytes)")
    return parser.parse_args()


def alternating(model: tuple[int, list[int], int], configs: Mapping[str, Mapping[str, Any]], args: argparse.Namespace,
                lr: float = 1e-3) -> dict[str, list[dict[str, Any]]]:
    """``two_workers`` on the MLP ``model`` (features, hidden widths, rows) for every configuration (its keyword
    arguments: nbdist.train's options), one after another, ``args.rounds`` times: each
    configuration's runs, in order."""
    dim, hidden, rows = model
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in configs}
    for _ in range(args.rounds):
        for label, kwargs in configs.items():
            runs[label].append(two_workers(build(dim, hidden, lr), rows, args.epochs, args.batch, **kwargs))
    return runs


def weight_gap(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The largest absolute difference between two runs' weights."""
    return float(max(np.abs(x - y).max() for x, y in zip(a, b)))
