"""Models, data and a device probe for check.py.

Imported by the notebook-side check and, by reference when the model is unpickled, by nbdist's
workers (check.sh puts this folder on PYTHONPATH, which the workers inherit).
"""
from __future__ import annotations

import time

import keras
import numpy as np


def _on_gpu() -> float:
    """1.0 when this process computes on a GPU (read where the step runs: in the worker for nbdist)."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        return 1.0 if jax.default_backend() == "gpu" else 0.0
    if backend == "torch":
        from keras.src.backend.torch.core import get_device

        return 1.0 if str(get_device()).startswith("cuda") else 0.0
    return 0.0


class OnGPU(keras.metrics.Metric):
    """Fraction of the training rows whose step ran on a GPU. Its two variables are sums, so nbdist's
    merge (metric variables summed over the workers) gives the fraction over all workers' rows."""

    def __init__(self, name: str = "on_gpu", **kwargs):
        super().__init__(name=name, **kwargs)
        self.gpu_rows = self.add_variable(shape=(), initializer="zeros", name="gpu_rows", dtype="float32")
        self.rows = self.add_variable(shape=(), initializer="zeros", name="rows", dtype="float32")

    def update_state(self, y_true, y_pred, sample_weight=None):
        backend = keras.backend.backend()
        if backend == "torch":  # eager: the tensor says where it is
            dev = getattr(y_pred, "device", None)
            flag = 1.0 if dev is not None and getattr(dev, "type", "") == "cuda" else 0.0
        else:  # JAX traces: where the process computes
            flag = _on_gpu()
        n = float(y_pred.shape[0]) if y_pred.shape[0] is not None else 0.0
        if n == 0.0:
            n = keras.ops.cast(keras.ops.shape(y_pred)[0], "float32")
        self.gpu_rows.assign_add(keras.ops.cast(n * flag, "float32"))
        self.rows.assign_add(keras.ops.cast(n, "float32"))

    def result(self):
        return self.gpu_rows / keras.ops.maximum(self.rows, 1.0)

    def reset_state(self):
        self.gpu_rows.assign(0.0)
        self.rows.assign(0.0)


def mlp(input_dim: int, hidden: list[int], classes: int = 10, lr: float = 1e-3, seed: int = 0,
        probe: bool = True, optimizer: str = "adam") -> keras.Model:
    """A compiled MLP with seeded initializers (the same weights for the same seed, without
    keras.utils.set_random_seed, which imports TensorFlow when it is installed)."""
    layers = [keras.Input((input_dim,))]
    for i, width in enumerate(hidden):
        layers.append(keras.layers.Dense(width, activation="relu",
                                         kernel_initializer=keras.initializers.GlorotUniform(seed=seed + i)))
    layers.append(keras.layers.Dense(classes, activation="softmax",
                                     kernel_initializer=keras.initializers.GlorotUniform(seed=seed + 100)))
    model = keras.Sequential(layers)
    metrics: list = ["accuracy"]
    if probe:
        metrics.append(OnGPU())
    opt = keras.optimizers.SGD(lr) if optimizer == "sgd" else keras.optimizers.Adam(lr)
    model.compile(opt, "sparse_categorical_crossentropy", metrics=metrics)
    return model


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (1797 x 64), scaled to [0, 1]."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.data / 16.0).astype(np.float32), d.target.astype(np.int32)


def generated(rows: int, dim: int, classes: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian rows labelled by a fixed random projection (learnable, deterministic for a seed)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    w = rng.standard_normal((dim, classes)).astype(np.float32)
    y = np.argmax(x @ w, axis=1).astype(np.int32)
    return x, y


class EpochTimer(keras.callbacks.Callback):
    """Each epoch's wall time in a local fit, on_epoch_begin to on_epoch_end (as nbdist's workers time theirs)."""

    def __init__(self):
        super().__init__()
        self.durations: list[float] = []
        self._t = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._t = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.durations.append(time.perf_counter() - self._t)
