"""Averaging sums each round through shared memory (one row, or chunk by chunk) or Gloo: all equal big-batch SGD;
a float64 model's rounds and gradient sums stay float64."""
from __future__ import annotations

import keras
import numpy as np
import pytest

import nbdist
from nbdist.strategies import shared

from ..conftest import mlp, relative_error
from .test_training import interleave_batches

pytestmark = pytest.mark.usefixtures("no_leftover_workers")
NEEDS_SHM = pytest.mark.skipif(not shared.supported_here(), reason="needs x86-64 and /dev/shm")
# How a round is summed: (shared_memory, direct_sum_bytes) and the summed_by the workers report.
SUMMING_PATHS = [pytest.param(True, 4 * 2**20, "shared", marks=NEEDS_SHM), (False, 4 * 2**20, "allreduce"),
                 pytest.param(True, 0, "shared-chunked", marks=NEEDS_SHM)]


def _beside_big_batch(local: keras.Model, remote: keras.Model, x, y, b: int = 16, **train):
    """``local`` fit on the global batch (2 workers' batches of ``b``, interleaved) and ``remote``, from the same
    weights, trained by nbdist on 2 workers for an epoch with ``train``'s options; the job."""
    remote.set_weights(local.get_weights())
    idx = interleave_batches(np.arange(len(x)), 2, b)
    local.fit(x[idx], y[idx], batch_size=2 * b, epochs=1, shuffle=False, verbose=0)
    return nbdist.train(remote, x, y, epochs=1, batch_size=b, workers=2, shuffle=False, **train)


@pytest.mark.parametrize("shared_memory,direct_sum_bytes,summed_by", SUMMING_PATHS)
def test_every_summing_path_equals_big_batch_sgd(digits, shared_memory, direct_sum_bytes, summed_by):
    """K=1, SGD, 2 workers with batch b == local fit with batch 2b, whichever way the rounds are summed."""
    local = mlp(seed=4, optimizer=keras.optimizers.SGD(0.1))
    remote = mlp(seed=4, optimizer=keras.optimizers.SGD(0.1))
    job = _beside_big_batch(local, remote, digits[0][:600], digits[1][:600], strategy="averaging",
                            averaging_frequency=1, shared_memory=shared_memory, direct_sum_bytes=direct_sum_bytes)
    assert [job.reports[r]["summed_by"] for r in range(2)] == [summed_by] * 2
    assert relative_error(remote.get_weights(), local.get_weights()) < 1e-5


def _wide(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16384, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.5), "sparse_categorical_crossentropy")
    return model


def _embedding(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,), dtype="int32"), keras.layers.Embedding(17 * 64, 1024),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy")
    return model


def _tokens(x: np.ndarray) -> np.ndarray:
    return np.rint(x * 16).astype("int32") + 17 * np.arange(64, dtype="int32")  # a token per pixel and value


@NEEDS_SHM
@pytest.mark.parametrize("build,inputs", [(_wide, np.asarray), (_embedding, _tokens)],
                         ids=["dense-momentum", "embedding-by-scatter"])
def test_a_large_model_averages_in_place_as_big_batch_sgd(digits, build, inputs):
    """Over 1M floats a round (weights and momenta) go through the shared segment from the variables' own
    memory and back into it (averaging.variable_views), still equal to big-batch SGD. SGD applies an
    Embedding's gradient with ``scatter_sub``, which puts its variable in TensorFlow's copy-on-read mode:
    a write into what a read returns would not reach it, so it is assigned back."""
    x, y = inputs(digits[0][:256]), digits[1][:256]
    b = 16
    local, remote = build(5), build(5)
    remote.set_weights(local.get_weights())
    idx = interleave_batches(np.arange(len(x)), 2, b)
    local.fit(x[idx], y[idx], batch_size=2 * b, epochs=1, shuffle=False, verbose=0)
    job = nbdist.train(remote, x, y, epochs=1, batch_size=b, workers=2,
                       strategy="averaging", averaging_frequency=1, shuffle=False)
    assert [job.reports[r]["summed_by"] for r in range(2)] == ["shared-chunked"] * 2
    assert relative_error(remote.get_weights(), local.get_weights()) < 1e-5
    assert relative_error(remote.optimizer.variables[1:], local.optimizer.variables[1:]) < 1e-5


def _float64(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu", dtype="float64"),
                              keras.layers.Dense(10, activation="softmax", dtype="float64")])
    model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy")
    return model


@pytest.mark.parametrize("shared_memory,direct_sum_bytes,summed_by", SUMMING_PATHS)
def test_a_float64_model_averages_in_float64(digits, shared_memory, direct_sum_bytes, summed_by):
    """A model of float64 layers keeps float64 weights through every round, as its local fit does: equal to
    big-batch SGD to float64's precision, where rounds summed in float32 rounded the weights to float32 each time
    (a relative error of about 1e-7, and every weight a float32 value)."""
    local, remote = _float64(6), _float64(6)
    job = _beside_big_batch(local, remote, digits[0][:320], digits[1][:320], strategy="averaging",
                            averaging_frequency=1, shared_memory=shared_memory, direct_sum_bytes=direct_sum_bytes)
    assert [job.reports[r]["summed_by"] for r in range(2)] == [summed_by] * 2
    weights = remote.get_weights()
    assert all(w.dtype == np.float64 for w in weights)
    assert any((w != w.astype(np.float32)).any() for w in weights)  # not rounded to float32
    assert relative_error(weights, local.get_weights()) < 1e-10


@pytest.mark.parametrize("shared_memory", [
    pytest.param(True, marks=NEEDS_SHM),
    False,
])
def test_a_float64_models_gradients_are_summed_in_float64(digits, shared_memory):
    """Under allreduce a float64 model's gradients are summed in float64 buckets: its step equals the local step on
    the global batch to float64's precision (summed in float32, 1.6e-8 apart after an epoch). On Keras' torch
    backend the loss itself is float32 (Keras' ``compute_loss``), so there the step is float32's anyway."""
    local, remote = _float64(7), _float64(7)
    job = _beside_big_batch(local, remote, digits[0][:320], digits[1][:320], strategy="allreduce",
                            shared_memory=shared_memory)
    assert [job.reports[r]["summed_by"] for r in range(2)] == ["shared" if shared_memory else "allreduce"] * 2
    assert relative_error(remote.get_weights(), local.get_weights()) < 1e-12


def test_a_float64_embeddings_slices_and_pad_steps_stay_float64(digits):
    """The sparse slices of a float64 Embedding travel as float64, and a pad step (257 rows: one worker has a step
    fewer) sums and applies float64 zeros: the local step on the global batch to float64's precision."""
    def build() -> keras.Model:
        keras.utils.set_random_seed(8)
        model = keras.Sequential([keras.Input((64,), dtype="int32"),
                                  keras.layers.Embedding(17 * 64, 8, dtype="float64"),
                                  keras.layers.GlobalAveragePooling1D(dtype="float64"),
                                  keras.layers.Dense(10, activation="softmax", dtype="float64")])
        model.compile(keras.optimizers.SGD(0.5), "sparse_categorical_crossentropy")
        return model

    local, remote = build(), build()
    job = _beside_big_batch(local, remote, _tokens(digits[0][:257]), digits[1][:257], strategy="allreduce")
    assert sum(job.reports[r]["padded_steps"] for r in range(2)) == 1
    assert relative_error(remote.get_weights(), local.get_weights()) < 1e-12
