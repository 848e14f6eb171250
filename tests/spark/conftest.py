"""Fixtures of the local[2] Spark test modules (test_spark_standalone.py brings its own ``spark``)."""
from __future__ import annotations

import numpy as np
import pytest

from ..spark_helpers import digits, spark_session


@pytest.fixture(autouse=True)
def no_warm_executor_workers(monkeypatch):
    """Executors' warm workers only where a test asks for them (test_spark_warm.py): the others count
    the processes a job leaves."""
    monkeypatch.setenv("NBDIST_WARM_WORKERS", "0")


@pytest.fixture(scope="module")
def spark():
    """A local[2] SparkSession for one test module, stopped after it."""
    session = spark_session("local[2]")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits split into train and test: (Xtr, Xte, ytr, yte)."""
    return digits()
