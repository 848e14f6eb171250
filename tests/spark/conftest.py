"""Fixtures of the local[2] Spark test modules: one SparkSession shared by them all.

The modules that take this conftest's ``spark`` run first, one after the other, on one local[2] session
(``spark_helpers.shared_local_session``); the modules with a Spark of their own (a standalone cluster,
Connect, hosts in network namespaces, warm executors) come after them, and their session's start stops
the shared one. A module still fails if it leaves any other session active (tests/conftest.py).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from ..spark_helpers import digits, shared_local_session, standalone_cluster, stop_shared_session


def on_shared(item) -> bool:
    """Whether the test runs on the shared local[2] session (this conftest's ``spark`` fixture)."""
    defs = getattr(item, "_fixtureinfo", None) and item._fixtureinfo.name2fixturedefs.get("spark")
    return bool(defs) and defs[-1].func.__module__ == __name__


def pytest_collection_modifyitems(items) -> None:
    """Within tests/spark/, the modules on the shared session first (order otherwise kept)."""
    here = __file__.rsplit("/", 1)[0] + "/"
    spark_items = [i for i, item in enumerate(items) if str(item.path).startswith(here)]
    if not spark_items:
        return

    modules: dict[str, bool] = {}
    for i in spark_items:
        modules[str(items[i].path)] = modules.get(str(items[i].path), False) or on_shared(items[i])
    chosen = sorted((items[i] for i in spark_items), key=lambda item: not modules[str(item.path)])
    for i, item in zip(spark_items, chosen):
        items[i] = item


@pytest.fixture
def warm_executors() -> bool:
    """Asked for by the tests whose executors keep warm workers, as a user's do (TrainConfig.warm_workers)."""
    return True


@pytest.fixture(autouse=True)
def no_warm_executor_workers(request, monkeypatch):
    """Executors' warm workers only where a test asks for them (``warm_executors``): the others' Spark backends
    get ``warm_workers=False``, as if each had passed it. Kept cold on purpose: run back to back, as tests run,
    warm spares import TensorFlow while the next test runs (and spares of another worker environment are never
    taken), which measured no faster on 2 cores. The checks of the processes a job leaves hold either way:
    they look at the job's own workers (spark_helpers.nbdist_worker_pids), an idle spare is not a leak, and
    the shared session's spares must end with it (``stop_shared_session``)."""
    if "warm_executors" in request.fixturenames:
        return
    from nbdist.config import TrainConfig
    from nbdist.spark.backend import SparkBackend

    init = SparkBackend.__init__

    def cold(self, session, config=None):
        init(self, session, (config or TrainConfig()).replace(warm_workers=False))

    monkeypatch.setattr(SparkBackend, "__init__", cold)


@pytest.fixture(scope="module")
def spark():
    """The local[2] SparkSession these modules share (stopped at the package's end or by another's start)."""
    return shared_local_session()


@pytest.fixture(scope="module")
def standalone(tmp_path_factory) -> Iterator[str]:
    """A standalone master and one worker of 2 cores on 127.0.0.1, for a module; its URL."""
    with standalone_cluster(tmp_path_factory) as master:
        yield master


@pytest.fixture(autouse=True, scope="package")
def shared_session_stopped() -> Iterator[None]:
    yield
    stop_shared_session()


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits split into train and test: (Xtr, Xte, ytr, yte)."""
    return digits()
