"""Shared fixtures: real data (scikit-learn digits) and a check that no worker outlives a test."""
from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# Local workers are forked from a warm fork server (backends/warm.py), as in a notebook: it saves each
# worker TensorFlow's import. The tests that need cold workers pass warm_workers=False themselves.

import numpy as np
import psutil
import pytest

# CI's budget for the whole run of pytest (`make test` on 2 cores; CI itself stops at 90 minutes).
CI_BUDGET_SECONDS = 35 * 60


def pytest_configure(config) -> None:
    """The tests interrupt themselves with SIGINT, as a kernel's interrupt button does, and a kernel always turns
    it into KeyboardInterrupt. A suite started in the background of a shell without job control (`cmd &` in a
    script) inherits SIGINT ignored, and Python then leaves it ignored: give it Python's own handler back."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser) -> None:
    parser.addoption("--full", action="store_true",
                     help="also run the tests marked full (make test-full); CI's make test leaves them out")


def pytest_collection_modifyitems(config, items) -> None:
    """``full``: a second case of a path CI already covers (the other backend on the same cluster kind, more
    strategies of one exchange); run by ``make test-full``, left out of ``make test`` to keep CI's budget."""
    if config.getoption("--full"):
        return
    for item in items:
        mark = item.get_closest_marker("full")
        if mark is not None:  # its argument, where given, names the CI test that covers the path
            covered = f" ({mark.args[0]})" if mark.args else ""
            item.add_marker(pytest.mark.skip(reason=f"a further case of a path CI covers{covered}: make test-full "
                                                    "runs it"))


SLOWEST_FILES = 20  # test files listed with their seconds after the tiers


def pytest_terminal_summary(terminalreporter) -> None:
    """Seconds per tier (setup, call and teardown of its tests) against CI's budget, then the slowest files.

    Printed by every run, so a tier that grows shows up in CI's log before the budget is gone, with the
    files where its time goes (a module's shared run is its first test's setup: --durations splits it).
    """
    tiers: dict[str, float] = {}
    files: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for rep in reports:
            nodeid, duration = getattr(rep, "nodeid", ""), getattr(rep, "duration", None)
            if nodeid and duration is not None and getattr(rep, "when", None):
                parts = nodeid.split("/")
                tier = parts[1] if len(parts) > 2 and parts[0] == "tests" else parts[0]
                tiers[tier] = tiers.get(tier, 0.0) + duration
                path = nodeid.split("::")[0]
                files[path] = files.get(path, 0.0) + duration
    if not tiers:
        return
    total = sum(tiers.values())
    terminalreporter.write_sep("=", f"time per tier: {total / 60:.1f} of CI's {CI_BUDGET_SECONDS // 60} minutes")
    for tier, seconds in sorted(tiers.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{tier:<12} {seconds / 60:5.1f} min  {100 * seconds / total:3.0f}%")
    terminalreporter.write_sep("-", f"the {SLOWEST_FILES} slowest files")
    for path, seconds in sorted(files.items(), key=lambda kv: -kv[1])[:SLOWEST_FILES]:
        terminalreporter.write_line(f"{seconds:7.1f} s  {path}")


@pytest.fixture(autouse=True, scope="session")
def no_fork_server_left() -> Iterator[None]:
    """At the end of the session, stopping the pool stops every fork server."""
    yield
    from nbdist.backends.warm import POOL

    POOL.close()
    left = [p for p in psutil.Process().children(recursive=True) if _is_fork_server(p)]
    psutil.wait_procs(left, timeout=15)
    assert not [p for p in left if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "fork servers left"


def _is_fork_server(proc: psutil.Process) -> bool:
    try:
        return "--fork-server" in proc.cmdline()
    except psutil.Error:
        return False


@pytest.fixture(autouse=True, scope="module")
def no_spark_session_left() -> Iterator[None]:
    """Fails the module that leaves a SparkSession active, and stops it.

    Runs with ``--backend auto`` attach to an active session, so one left behind would send every
    later test's workers to Spark and fail them with a sentence about Spark task slots. The local[2]
    session the modules of tests/spark/ share outlives each of them on purpose (its package stops it).
    """
    yield
    if "pyspark" not in sys.modules:
        return
    from nbdist.spark.backend import active_spark_session

    from .spark_helpers import is_shared_session

    session = active_spark_session()
    if session is not None and not is_shared_session(session):
        session.stop()
        pytest.fail(f"this module left a SparkSession active ({session!r}); stop it in the fixture that made it")


@pytest.fixture(scope="session")
def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16).astype("float32"), y.astype("int64")


@pytest.fixture(scope="session")
def digits_split(digits):
    from sklearn.model_selection import train_test_split

    x, y = digits
    return train_test_split(x, y, test_size=0.25, random_state=0)


def worker_processes() -> list[psutil.Process]:
    """nbdist workers started by this test process or its children; not the fork servers they come
    from, which stay for the next job (the session's end stops them: ``no_fork_server_left``), nor
    the idle warm workers Spark executors keep for the next run (they end with Spark:
    ``spark_helpers.stop_shared_session``)."""
    from .spark_helpers import is_idle_spare

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = child.cmdline()
            if "nbdist.worker" in " ".join(cmd) and "--fork-server" not in cmd and not is_idle_spare(cmd):
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


def run_ranks(target, world: int = 2, timeout: float = 90.0) -> dict:
    """``target(rank, ports, results)`` in ``world`` spawned processes, sharing two queues (rank 0 puts the
    ports the others need, each puts ``(rank, *result)`` once); their results by rank. None is left running."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, ports, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return {r: rest for r, *rest in (results.get(timeout=timeout) for _ in procs)}
    finally:  # every result is in (or never comes): what still runs is killed
        for p in procs:
            p.kill()
            p.join(10)


def wait_no_workers(timeout: float = 5.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = worker_processes()
        if not left:
            return []
        time.sleep(0.1)
    return worker_processes()


def ipython_shell():
    """The one IPython shell of the test session, with nbdist loaded.

    IPython's shell is a process-wide singleton: every test module must share it rather
    than create its own (a second, different shell class raises MultipleInstanceError).
    """
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    return shell


@pytest.fixture(scope="module")
def ip(digits):
    """The shared IPython shell with nbdist loaded and digits as X, y (600 rows) and Xv, yv (200)."""
    shell = ipython_shell()
    x, y = digits
    shell.user_ns.update(X=x[:600], y=y[:600], Xv=x[600:800], yv=y[600:800])
    yield shell


@pytest.fixture
def no_leftover_workers():
    yield
    left = wait_no_workers()
    assert not left, f"worker processes left behind: {[p.pid for p in left]}"


def mlp(seed: int = 0, optimizer: str | object = "adam"):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def relative_error(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """Largest per-tensor ||a - b|| / ||b||."""
    return max(float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-12)) for x, y in zip(a, b))
