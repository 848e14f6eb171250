"""Warm workers on Spark executors (spark/warm.py).

Real worker processes on real Unix sockets: a claim hands over the job and later the worker's
own exit code, only one task can take a worker, a taken worker dies with its task's connection,
a waiting one ends with the process it watches, and an unsafe directory is refused. Then a real
local[2] SparkContext: the second run takes the workers the first left, and they end with Spark.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nbdist.backends.command import worker_env
from nbdist.machine.processes import ProcessId
from nbdist.spark import warm as spark_warm
from nbdist.wire import protocol
from nbdist.wire.handover import job_line

from ..spark_helpers import own_warm_spares, wait_warm_ready

pytestmark = pytest.mark.timeout(240)
ENV = worker_env(1)


def _me() -> tuple[int, int]:
    me = ProcessId.of(os.getpid())
    return me.pid, me.start


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ProcessId.of(pid) is None:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def tmp_path():
    """A short directory: a Unix socket's path holds at most 107 bytes, pytest's are longer."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="nbw", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_the_directory_is_private_or_refused(tmp_path):
    d = spark_warm.pool_dir((1, 2), root=str(tmp_path))
    assert d is not None and d.is_dir()
    assert d.stat().st_mode & 0o777 == 0o700 and d.parent.stat().st_mode & 0o777 == 0o700
    d.chmod(0o755)  # others could list it and see which workers wait
    assert spark_warm.pool_dir((1, 2), root=str(tmp_path)) is None
    deep = str(tmp_path / ("x" * 60))  # sockets would not fit: the short fallback serves instead
    assert spark_warm.pool_dir((3, 4), root=deep, fallback_root=str(tmp_path)) == (
        tmp_path / f"nbdist-warm-{os.getuid()}" / "3-4")
    assert spark_warm.pool_dir((3, 4), root=deep, fallback_root=deep) is None


# Holds a process's first import of TensorFlow for 1 s (100 times the test's poll): a socket bound before that
# import is seen before TensorFlow's libraries are mapped on any machine, however quickly it imports.
SLOW_TENSORFLOW = """import sys, time
class HoldTensorFlow:
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow":
            sys.meta_path.remove(self)
            time.sleep(1)
        return None
sys.meta_path.insert(0, HoldTensorFlow())
"""


def test_a_claim_hands_over_the_job_and_returns_the_workers_own_exit_code(tmp_path):
    """Claimed as soon as its socket is there, before TensorFlow loads (a back-to-back run's task queues for
    it and waits for the imports), the worker takes the job and the task gets the worker's own exit code."""
    (tmp_path / "hold").mkdir()
    (tmp_path / "hold" / "sitecustomize.py").write_text(SLOW_TENSORFLOW)
    env = {**ENV, "PYTHONPATH": os.pathsep.join((str(tmp_path / "hold"), ENV["PYTHONPATH"]))}
    directory = spark_warm.pool_dir(_me(), root=str(tmp_path))
    proc = spark_warm.start(directory, env, _me())
    try:
        deadline = time.monotonic() + 60
        while not list(directory.glob("*.sock")):
            assert time.monotonic() < deadline and proc.poll() is None, "the warm worker never bound its socket"
            time.sleep(0.01)
        assert "tensorflow" not in Path(f"/proc/{proc.pid}/maps").read_text()  # bound first thing
        assert spark_warm.claim(directory, {**env, "OMP_NUM_THREADS": "7"}, b"{}\n", b"k") is None  # other env
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        closed.close()  # nobody listens there: the worker's connection is refused
        worker = spark_warm.claim(directory, env, job_line(("127.0.0.1", port), 0, {"NBDIST_X": "1"}), b"\x01" * 16)
        assert worker is not None and worker.pid == proc.pid
        assert spark_warm.claim(directory, env, b"{}\n", b"k") is None  # taken: nobody else gets it
        # Its own code, sent on the socket, not a guess: a worker that cannot reach its driver says so.
        assert worker.wait(timeout=60) == protocol.EXIT_UNREACHABLE
        assert "cannot reach the notebook's coordinator at 127.0.0.1:" in worker.log_path.read_text(errors="replace")
        assert not list(directory.glob("*.sock"))
    finally:
        proc.kill()
        proc.wait()


def test_a_taken_worker_dies_with_its_tasks_connection(tmp_path):
    directory = spark_warm.pool_dir(_me(), root=str(tmp_path))
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers the handshake
    proc = spark_warm.start(directory, ENV, _me())
    try:
        wait_warm_ready(directory, 1)
        worker = spark_warm.claim(directory, ENV, job_line(silent.getsockname(), 0, {}), b"\x01" * 16)
        assert worker is not None and worker.poll() is None
        worker._conn.close()  # the task's Python process is gone
        assert proc.wait(timeout=15) == 3
    finally:
        proc.kill()
        proc.wait()
        silent.close()


def test_a_waiting_worker_ends_with_the_process_it_watches(tmp_path):
    executor = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        who = ProcessId.of(executor.pid)
        directory = spark_warm.pool_dir((who.pid, who.start), root=str(tmp_path))
        proc = spark_warm.start(directory, ENV, (who.pid, who.start))
        wait_warm_ready(directory, 1)
        executor.kill()
        executor.wait()
        assert proc.wait(timeout=15) == 0
        assert not list(directory.iterdir())  # its socket and log are gone with it
    finally:
        executor.kill()


def test_spark_second_run_takes_the_warm_workers_and_they_end_with_spark(warm_executors):
    from ..spark_helpers import accuracy, digits, need_spark, small_model, spark_session

    need_spark()
    import nbdist

    Xtr, Xte, ytr, yte = digits()
    assert not own_warm_spares()
    spark = spark_session("local[2]")
    waiting: dict[int, Path] = {}
    try:
        rdd = spark.sparkContext.parallelize(list(zip(Xtr.tolist(), ytr.tolist())), 2)
        first = nbdist.train(small_model(), rdd, epochs=2, workers=2, backend="spark", ui="none")
        assert [w.warm for w in first._backend.workers] == [False, False]
        left = own_warm_spares()  # one per task, for the next job
        assert len(left) == 2 and len({s.parent for s in left.values()}) == 1, left
        wait_warm_ready(next(iter(left.values())).parent, 2)
        model = small_model()
        second = nbdist.train(model, rdd, epochs=8, workers=2, backend="spark", ui="none")
        assert [w.warm for w in second._backend.workers] == [True, True]
        assert {w.pid for w in second._backend.workers} == set(left)
        assert accuracy(model, Xte, yte) > 0.8
        assert all(_gone(pid, 15) for pid in left)  # each ran its one job and exited
        waiting = own_warm_spares()  # the next run's
        assert len(waiting) == 2 and not set(waiting) & set(left)
    finally:
        spark.stop()
    assert all(_gone(pid, 15) for pid in waiting)  # Spark is gone, so are they
    assert not any(s.exists() for s in waiting.values())
