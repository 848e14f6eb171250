"""``weighted_psum`` (issue 36, ``--engine jax``): the gradients summed inside the step equal
sum_w (n_w / N) g_w computed with numpy, per gradient, with uneven rows and a missing gradient. Two virtual
CPU devices in this process stand for two workers (the same XLA all-reduce; across processes it runs over
Gloo, checked against the local fit in tests/workers/test_jax_engine.py)."""
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


def test_weighted_psum_equals_numpy_weighted_by_rows():
    from jax.sharding import Mesh, PartitionSpec

    from nbdist.strategies.jax_device_sum import weighted_psum

    mesh = Mesh(np.array(two_devices()), ("w",))
    rng = np.random.default_rng(0)
    rows = np.array([3, 5])
    a = rng.normal(size=(2, 4, 3)).astype(np.float32)  # per worker: a (4, 3) kernel, a (3,) bias
    b = rng.normal(size=(2, 3)).astype(np.float32)

    def body(ga, gb, n):
        return tuple(weighted_psum([ga[0], None, gb[0]], n[0], "w")[i] for i in (0, 2))

    # The rows are a traced value here (a Python int in the engine): the same arithmetic either way.
    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=PartitionSpec("w"), out_specs=PartitionSpec(),
                                 check_vma=False))
    got_a, got_b = step(a, b, rows.astype(np.float32))
    weights = rows / rows.sum()
    np.testing.assert_allclose(np.asarray(got_a), np.tensordot(weights, a, 1), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(np.asarray(got_b), np.tensordot(weights, b, 1), rtol=1e-6, atol=1e-7)
