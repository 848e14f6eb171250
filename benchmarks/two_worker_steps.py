"""What the engine benchmarks share (tf_device_sum.py, torch_overlap.py, jax_engine.py): a seeded MLP, and
ms per step of 2 local allreduce workers training it on generated rows, with the environment their workers
inherit. Import it after the script has chosen its Keras backend (KERAS_BACKEND)."""
from __future__ import annotations

import os
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


def two_workers(model: keras.Model, rows: int, epochs: int, batch: int, env: dict[str, str] | None = None,
                **options: Any) -> dict[str, Any]:
    """Train ``model`` on 2 local workers (``batch`` rows each per step) on ``rows`` generated rows; ``env`` is
    set while they start (they inherit it). Returns ms per step (epochs after the first), the slowest worker's
    sync ms per round, the weights and each worker's ``summed_by``."""
    dim = int(model.inputs[0].shape[-1])
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(rows, dim)).astype("float32"), rng.integers(0, 10, rows)
    env = env or {}
    os.environ.update(env)
    try:
        job = nbdist.train(model, x, y, workers=2, strategy="allreduce", epochs=epochs, batch_size=batch,
                           shuffle=False, lr_scaling="none", ui="none", **options)
    finally:
        for key in env:
            del os.environ[key]
    seconds = job.state.epoch_seconds[1:]
    reports = [job.reports[r] for r in range(2)]
    return {"ms_per_step": 1000 * sum(seconds) / len(seconds) / (rows // (2 * batch)),
            "sync_ms": max(1000 * r["sync_seconds"] / max(1, r["rounds"]) for r in reports),
            "weights": model.get_weights(), "summed_by": [str(r["summed_by"]) for r in reports]}
