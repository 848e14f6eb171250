"""Issues 16 and 17 in Podman containers: a notebook-defined loss with a subclassed model, and an unchanged
cell's own model.fit with callbacks and class_weight. Skipped without a usable container engine."""
from __future__ import annotations

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

import nbdist
from nbdist.backends.containers import Engine, find_engine
from nbdist.errors import NbdistError

from ..models_and_fit import (
    check_intercepted_fit,
    check_subclassed_run,
    notebook_subclassed_model,
)
from ..workers.test_backends import assert_remote_run, run_driver

EPOCHS = 12


@pytest.fixture(scope="module")
def engine() -> Engine:
    try:
        return find_engine()
    except NbdistError as exc:
        pytest.skip(str(exc))


@pytest.mark.full("notebook objects by value on a remote kind: tests/spark/test_spark_models_and_fit.py's "
                  "notebook-loss test")
def test_notebook_loss_and_subclassed_model_train_in_containers(engine, digits_split):
    """Containers get the notebook's loss function and model class (built with build()) by value."""
    x_train, x_test, y_train, y_test = digits_split
    local = notebook_subclassed_model(5)
    # The global batch of 2 workers x 32 under allreduce, in order: local Adam's steps, so the accuracies
    # agree (with shuffling, one seed's order alone moves this model's test accuracy by 2 points).
    local.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, verbose=0, shuffle=False)
    model = notebook_subclassed_model(5)
    job = nbdist.train(model, x_train, y_train, epochs=EPOCHS, batch_size=32, workers=2, shuffle=False,
                       strategy="allreduce", backend="containers", ui="none")
    assert job.status == "done" and job.state.backend == "containers"
    check_subclassed_run(job, model, local, x_test, y_test, EPOCHS)


@pytest.mark.full("the same cell on Spark tasks: tests/spark/test_spark_models_and_fit.py; notebook objects in "
                  "containers: test_notebook_loss_and_subclassed_model_train_in_containers")
def test_intercepted_fit_with_callbacks_and_class_weight(engine, ip, tmp_path):
    check_intercepted_fit(ip, "--workers 2 --backend containers --strategy allreduce --ui none", tmp_path)


@pytest.mark.timeout(600)
@pytest.mark.full("a JAX or torch notebook's workers on a remote kind: tests/spark/test_spark_backends.py (torch), "
                  "test_spark_connect.py (JAX)")
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_jax_or_torch_notebook_trains_in_containers_as_locally(engine, backend):
    """Issue 25: the default image mounts this machine's Python, so its JAX and torch; a notebook of its own
    on that backend (Keras reads KERAS_BACKEND once per process)."""
    assert_remote_run(run_driver(backend, "containers"), backend)
