"""A notebook on Keras' JAX or torch backend trains and evaluates on a local[2] Spark session (issue 25).

The notebook is a process of its own (tests/workers/backend_driver.py: Keras reads KERAS_BACKEND once)
with its own session; the Connect run is in test_spark_connect.py, on that module's server.
"""
from __future__ import annotations

import pytest

from ..spark_helpers import need_spark
from ..workers.test_backends import assert_remote_run, run_driver

need_spark()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", [pytest.param("jax", marks=pytest.mark.full), "torch"])  # JAX: Connect's
def test_a_jax_or_torch_notebook_trains_on_spark_as_locally(backend, no_leftover_workers):
    assert_remote_run(run_driver(backend, "spark"), backend)
