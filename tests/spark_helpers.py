"""Shared pieces of the Spark tests: a SparkSession, digits as a DataFrame, a reference model."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

PYTHON = sys.executable


def need_spark() -> None:
    pytest.importorskip("pyspark")
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java: run scripts/install_system_deps.sh")


_SHARED: list[Any] = []  # the one local[2] session of the modules that share it (tests/spark/conftest.py)


def shared_local_session() -> Any:
    """The local[2] SparkSession that the test modules of tests/spark/ share, started on first use.

    A JVM's start per module was the tier's largest fixed cost; the modules on the plain local[2]
    session run one after the other (tests/spark/conftest.py orders them first) on this one, and
    ``stop_shared_session`` ends it before a module that needs its own (``spark_session``) and at
    the end of the package.
    """
    if not _SHARED:
        _SHARED.append(spark_session("local[2]"))
    return _SHARED[0]


def is_shared_session(session: Any) -> bool:
    return bool(_SHARED) and session is _SHARED[0]


def stop_shared_session() -> None:
    """Stop the shared session; the warm workers its executor kept for a next run end with it."""
    while _SHARED:
        spares = own_warm_spares()
        _SHARED.pop().stop()
        left = [pid for pid in spares if not _gone(pid, 120)]  # one still importing notices once imported
        assert not left, f"warm workers outlived the shared Spark session: {left}"


def spark_session(master: str, **conf: str) -> Any:
    """A new SparkSession; the shared local[2] one is stopped first (``getOrCreate`` would return it)."""
    from pyspark.sql import SparkSession

    stop_shared_session()
    # Executors run this interpreter, so they import the same numpy/TensorFlow/nbdist.
    os.environ["PYSPARK_PYTHON"] = PYTHON
    builder = (SparkSession.builder.master(master).appName("nbdist-tests")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.pyspark.python", PYTHON)
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.driver.bindAddress", "127.0.0.1"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X = (X / 16).astype("float32")
    return tuple(train_test_split(X, y, test_size=0.2, random_state=0, stratify=y))  # type: ignore[return-value]


def digits_frame(spark: Any, X: np.ndarray, y: np.ndarray, partitions: int = 2) -> Any:
    rows = [(x.tolist(), int(label)) for x, label in zip(X, y)]
    return spark.createDataFrame(rows, ["pixels", "digit"]).repartition(partitions)


def small_model(seed: int = 0) -> Any:
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def accuracy(model: Any, X: np.ndarray, y: np.ndarray) -> float:
    return float((model.predict(X, verbose=0).argmax(axis=1) == y).mean())


def nbdist_worker_pids(job: Any) -> list[int]:
    """Live worker processes of this job: the pids its tasks reported (a warm worker an executor kept took
    the job: its command line names no coordinator) and any process started for its coordinator.

    The idle warm worker a task leaves for the next run is not the job's (``own_warm_spares``).
    """
    import psutil

    host, port = job._coordinator.address
    reported = {w.pid for w in job._handles if getattr(w, "pid", None)}
    pids = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = p.info.get("cmdline") or []
        if p.info.get("status") == psutil.STATUS_ZOMBIE or "nbdist.worker" not in cmd:
            continue
        if p.info["pid"] in reported or f"{host}:{port}" in cmd:
            pids.append(p.info["pid"])
    return pids


def wait_until_no_workers(job: Any, timeout: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while nbdist_worker_pids(job) and time.monotonic() < deadline:
        time.sleep(0.5)
    return nbdist_worker_pids(job)


def wait_warm_ready(directory: Path, count: int, timeout: float = 120.0) -> list[Path]:
    """The socket files in ``directory`` of ``count`` warm workers that have finished importing."""
    from nbdist.wire.handover import READY

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        socks = sorted(directory.glob("*.sock"))
        logs = [s.with_suffix(".log") for s in socks]
        if len(socks) >= count and all(READY in log.read_text(errors="replace") for log in logs):
            return socks
        time.sleep(0.2)
    raise AssertionError(f"{count} warm workers not ready in {timeout:.0f} s: {list(directory.iterdir())}")


def own_warm_spares() -> dict[int, Path]:
    """Idle warm workers kept by executors of this test process's Spark (their ``--watch`` process is one of
    its descendants), waiting on their socket for a next run: pid -> socket path. Other runs on the machine
    (a colleague's, another test process's) keep their own."""
    import psutil

    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    out = {}
    for pid, sock in warm_socket_workers().items():
        try:
            cmd = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        watched = int(cmd[cmd.index("--watch") + 1].split(":")[0]) if "--watch" in cmd else -1
        if watched in mine and is_idle_spare(cmd):
            out[pid] = sock
    return out


def is_idle_spare(cmdline: list[str]) -> bool:
    """A warm worker no task has taken: its socket (once it listens) or its log (while it imports) is still
    where it was started; a task that takes it renames the one and moves the other (spark/warm.py)."""
    if "--warm-socket" not in cmdline:
        return False
    sock = Path(cmdline[cmdline.index("--warm-socket") + 1])
    return sock.exists() or sock.with_suffix(".log").exists()


def _gone(pid: int, timeout: float) -> bool:
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def warm_socket_workers() -> dict[int, Path]:
    """Warm workers waiting on Spark executors of this machine: pid -> socket path."""
    import psutil

    out = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if "--warm-socket" in cmd:
            out[p.info["pid"]] = Path(cmd[cmd.index("--warm-socket") + 1])
    return out


def partition_order(n: int, workers: int, batch: int) -> np.ndarray:
    """The order of ``n`` rows in which in-memory training trains as Spark tasks holding contiguous equal
    parts do: in memory every global batch of ``workers * batch`` rows is dealt over the workers
    (``nbdist.train(model, x, y)`` is ``model.fit``, data.deal_rows), so global batch j is worker 0's
    batch j of its part, then worker 1's, ..."""
    parts = np.array_split(np.arange(n), workers)
    steps = -(-len(parts[0]) // batch)
    return np.concatenate([p[j * batch:(j + 1) * batch] for j in range(steps) for p in parts])



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Spark daemon exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"nothing listens on port {port} after {timeout} s")


@contextlib.contextmanager
def standalone_cluster(tmp_path_factory: Any, cores: int = 2, memory: str = "2g") -> Iterator[str]:
    """A standalone master and one worker of ``cores`` cores on 127.0.0.1; yields the master's URL. Both daemons
    (and their executors) are gone afterwards."""
    import pyspark

    home = Path(pyspark.__file__).parent
    spark_class = str(home / "bin" / "spark-class")
    env = dict(os.environ, SPARK_HOME=str(home), SPARK_LOCAL_IP="127.0.0.1",
               SPARK_WORKER_DIR=str(tmp_path_factory.mktemp("spark-work")), PYSPARK_PYTHON=PYTHON)
    port = _free_port()
    logs = tmp_path_factory.mktemp("spark-logs")
    procs = []
    try:
        with open(logs / "master.log", "wb") as log:  # the daemon keeps its own copy of the descriptor
            procs.append(subprocess.Popen(
                [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
                 "--webui-port", str(_free_port())],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        _wait_for_port(port, procs[0], 120)
        wport = _free_port()
        with open(logs / "worker.log", "wb") as log:
            procs.append(subprocess.Popen(
                [spark_class, "org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
                 "--host", "127.0.0.1", "--port", str(wport), "--webui-port", str(_free_port()),
                 "--cores", str(cores), "--memory", memory],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        _wait_for_port(wport, procs[1], 120)
        yield f"spark://127.0.0.1:{port}"
    finally:
        for proc in reversed(procs):  # each daemon leads its own group, executors included
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=15)
                    break
                except subprocess.TimeoutExpired:
                    continue


@contextlib.contextmanager
def connect_server(tmp_path_factory: Any, master: str, **conf: str) -> Iterator[tuple[Any, str]]:
    """A Spark Connect server (PySpark's own) of ``master`` with ``conf`` on a free loopback port; yields a client
    session to it and its URL. The server is gone afterwards, and so are the variables ``remote()`` set."""
    import pyspark
    from pyspark.sql import SparkSession

    home = str(Path(pyspark.__file__).parent)
    if not list(Path(home, "jars").glob("spark-connect_*.jar")):
        pytest.skip(f"PySpark {pyspark.__version__}'s package has no Spark Connect server (Spark 3.5 fetches it "
                    "from Maven with --packages, which this machine cannot reach)")
    port = _free_port()
    environ_before = set(os.environ)
    log_path = tmp_path_factory.mktemp("connect") / "server.log"
    env = {**os.environ, "SPARK_HOME": home, "PYSPARK_PYTHON": PYTHON, "SPARK_LOCAL_IP": "127.0.0.1"}
    conf = {"spark.connect.grpc.binding.address": "127.0.0.1", "spark.connect.grpc.binding.port": str(port),
            "spark.ui.enabled": "false", "spark.pyspark.python": PYTHON, "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1", **conf}
    cmd = [os.path.join(home, "bin", "spark-submit"), "--master", master,
           "--class", "org.apache.spark.sql.connect.service.SparkConnectServer"]
    for key, value in conf.items():
        cmd += ["--conf", f"{key}={value}"]
    with open(log_path, "wb") as out:
        server = subprocess.Popen([*cmd, "spark-internal"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the Connect server did not open its port"
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                time.sleep(0.5)
        url = f"sc://127.0.0.1:{port}"
        session = SparkSession.builder.remote(url).getOrCreate()
        yield session, url
        session.stop()
    finally:
        # remote() leaves SPARK_CONNECT_MODE_ENABLED (and friends) in os.environ, which turns every later
        # SparkSession.builder...getOrCreate() in this process into a Connect client: the next test
        # modules' local[2] sessions would fail.
        for key in set(os.environ) - environ_before:
            del os.environ[key]
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
