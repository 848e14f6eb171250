"""``weighted_psum`` (issue 36, ``--engine jax``): the gradients summed inside the step equal
sum_w (n_w / N) g_w computed with numpy, per gradient, with uneven rows and a missing gradient, in one bucket
(CPUs) and one sum per gradient (GPUs); the averaging round's ``weighted_mean`` likewise, and a round where no
worker trained keeps the values. Two virtual
CPU devices in this process stand for two workers (the same XLA all-reduce; across processes it runs over
Gloo, checked against the local fit in tests/workers/test_backends.py)."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")


def two_devices() -> list:
    from jax._src import xla_bridge

    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_num_cpu_devices", 2)
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("JAX's CPU backend started earlier in this process with one device")
    return devices[:2]


@pytest.mark.parametrize("fused", [True, False], ids=["one-bucket-cpu", "per-gradient-gpu"])
def test_weighted_psum_equals_numpy_weighted_by_rows(fused):
    from jax.sharding import Mesh, PartitionSpec

    from nbdist.strategies.jax_device_sum import weighted_psum

    mesh = Mesh(np.array(two_devices()), ("w",))
    rng = np.random.default_rng(0)
    rows = np.array([3, 5])
    a = rng.normal(size=(2, 4, 3)).astype(np.float32)  # per worker: a (4, 3) kernel, a (3,) bias
    b = rng.normal(size=(2, 3)).astype(np.float32)

    def body(ga, gb, n):
        return tuple(weighted_psum([ga[0], None, gb[0]], n[0], "w", fused)[i] for i in (0, 2))

    # The rows are a traced value here (a Python int in the engine): the same arithmetic either way.
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("w"), out_specs=PartitionSpec(),
                                 check_vma=False))
    got_a, got_b = step(a, b, rows.astype(np.float32))
    weights = rows / rows.sum()
    np.testing.assert_allclose(np.asarray(got_a), np.tensordot(weights, a, 1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got_b), np.tensordot(weights, b, 1), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("fused", [True, False], ids=["one-bucket-cpu", "per-gradient-gpu"])
def test_weighted_mean_averages_by_samples_and_keeps_values_when_nobody_trained(fused):
    from jax.sharding import Mesh, PartitionSpec

    from nbdist.strategies.jax_device_sum import weighted_mean

    mesh = Mesh(np.array(two_devices()), ("w",))
    rng = np.random.default_rng(1)
    kernel = rng.normal(size=(2, 4, 3)).astype(np.float32)
    bias = rng.normal(size=(2, 3)).astype(np.float16)  # a mixed-precision variable keeps its dtype

    def body(k, b, n):
        values, total = weighted_mean([k[0], b[0]], n[0], "w", fused)
        return values[0][None], values[1][None], total[None]

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("w"), out_specs=PartitionSpec("w"),
                                 check_vma=False))
    samples = np.array([96.0, 32.0], np.float32)
    got_k, got_b, total = step(kernel, bias, samples)
    weights = samples / samples.sum()
    for w in range(2):  # every worker ends with the average
        np.testing.assert_allclose(np.asarray(got_k)[w], np.tensordot(weights, kernel, 1), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(got_b)[w], np.tensordot(weights, bias.astype(np.float32), 1),
                                   rtol=1e-3, atol=1e-3)
    assert np.asarray(got_b).dtype == np.float16 and list(np.asarray(total)) == [128.0, 128.0]
    got_k, got_b, total = step(kernel, bias, np.zeros(2, np.float32))  # a padding round nobody trained in
    np.testing.assert_array_equal(np.asarray(got_k), kernel)
    np.testing.assert_array_equal(np.asarray(got_b), bias)
