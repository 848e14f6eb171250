"""Spark backend: workers are barrier tasks of the notebook's own SparkContext.

The Spark job runs on a background thread under a job group named for the run,
so stopping the run cancels exactly its tasks. Each task starts the same worker
program as the local backend (see spark_task.run_task) and reports, over an
authenticated side channel, which process it started and how that process
ended: the driver then knows each worker's exit code and log tail without
reading executor logs.
"""
from __future__ import annotations

import functools
import logging
import socket
import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

from ..backends.warm import wanted_count
from ..errors import NbdistError
from ..wire import protocol
from .task import TaskSpec, run_task

log = logging.getLogger(__name__)

NO_SPARK = ("--backend spark needs an active SparkContext and there is none; start one first, e.g. "
            "spark = SparkSession.builder.master('local[2]').getOrCreate().")


def active_spark_context() -> Any | None:
    """The notebook's running SparkContext (Zeppelin's ``sc``, a SparkSession's), if any.

    Only looks when pyspark is already imported: a notebook with Spark has imported it.
    """
    if "pyspark" not in sys.modules:
        return None
    from pyspark import SparkContext

    sc = SparkContext._active_spark_context
    if sc is None or getattr(sc, "_jsc", None) is None:  # stopped contexts keep the class attribute briefly
        return None
    return sc


def coordinator_host(master: str, driver_host: str | None,
                     resolve: Callable[[str], str] = socket.gethostbyname) -> str:
    """Where the coordinator listens: the driver address executors use, loopback when that is local."""
    if master.startswith("local"):
        return "127.0.0.1"
    host = driver_host or socket.gethostname()
    try:
        ip = resolve(host)
    except OSError:
        ip = host
    return "127.0.0.1" if ip.startswith("127.") else ip


def task_slots(sc: Any) -> int:
    """How many tasks can run at once, which a barrier stage needs for all its tasks."""
    cpus = int(sc.getConf().get("spark.task.cpus", "1") or 1)
    return max(1, sc.defaultParallelism // max(1, cpus))


def summarize_spark_error(exc: BaseException) -> str:
    """The first line of what Spark said, without the Py4J stack."""
    java = getattr(exc, "java_exception", None)
    text = ""
    if java is not None:
        try:
            text = str(java.getMessage() or "")
        except Exception:
            text = ""
    text = text or str(exc)
    for line in text.splitlines():
        line = line.strip()
        if line:
            if "No module named 'nbdist'" in text:
                return ("the executors cannot import nbdist; install it where the executors run "
                        "(or ship it with sc.addPyFile).")
            return line[:500]
    return type(exc).__name__


class SparkTaskWorker:
    """The driver's view of one task's worker, filled in by the task's reports."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.pid: int | None = None
        self.host = ""
        self.code: int | None = None
        self.log = ""
        self.warm = False  # the task took a worker that had imported TensorFlow already
        self.spark_error = ""  # set when the Spark job itself failed or was cancelled

    def exit_status(self) -> int | None:
        return self.code

    def describe(self) -> str:
        where = f", pid {self.pid} on {self.host}" if self.pid else ""
        why = f"; its Spark job failed: {self.spark_error}" if self.spark_error else ""
        return f"worker {self.rank} (Spark task {self.rank}{where}{why})"

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.splitlines()[-lines:])


class SparkBackend:
    name = "spark"
    store_on_link = True  # rank 0 binds the rendezvous store on its own executor, not the driver's host

    def __init__(self, sc: Any) -> None:
        self.sc = sc
        self.bind_host = self.advertise_host = coordinator_host(sc.master, sc.getConf().get("spark.driver.host", None))
        self.gloo_ifname = "lo" if self.bind_host == "127.0.0.1" else None
        self.train_data: Any = None  # a SparkData, set by the job when the data lives on the executors
        self.group = f"nbdist-{uuid.uuid4().hex[:12]}"
        self.workers: list[SparkTaskWorker] = []
        self.job_error: str | None = None
        self._thread: threading.Thread | None = None
        self._server: socket.socket | None = None
        self._closed = threading.Event()
        self._secret = b""

    def default_workers(self) -> int:
        return task_slots(self.sc)

    def launch(self, world_size: int, address: tuple[str, int], secret: bytes,
               threads_per_worker: int) -> list[SparkTaskWorker]:
        slots = task_slots(self.sc)
        if world_size > slots:
            raise NbdistError(f"{world_size} workers need {world_size} Spark task slots at once (barrier mode) "
                              f"but this SparkContext has {slots}; use --workers {slots} or fewer.")
        self._secret = secret
        self.workers = [SparkTaskWorker(r) for r in range(world_size)]
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.bind((self.bind_host, 0))
        self._server.listen(64)
        status_address = (self.advertise_host, self._server.getsockname()[1])
        threading.Thread(target=self._accept, name="nbdist-spark-status", daemon=True).start()
        data = self.train_data
        if data is not None:
            rdd, layout, expected = data.rdd, data.layout, tuple(data.sizes or ())
        else:  # numpy/pandas data travels over the wire; the tasks only host the workers
            rdd, layout, expected = self.sc.parallelize(range(world_size), world_size), None, ()
        if rdd.getNumPartitions() != world_size:
            raise NbdistError(f"the data has {rdd.getNumPartitions()} partitions for {world_size} workers.")
        spec = TaskSpec(address=tuple(address), status_address=status_address, secret_hex=secret.hex(),
                        threads=threads_per_worker, layout=layout, expected_rows=expected,
                        warm=wanted_count(1) > 0)  # NBDIST_WARM_WORKERS=0 turns executors' warm workers off
        self._thread = threading.Thread(target=self._run, args=(rdd, spec), name="nbdist-spark-job", daemon=True)
        self._thread.start()
        log.info("started Spark job group %s with %d barrier tasks", self.group, world_size)
        return list(self.workers)

    def _run(self, rdd: Any, spec: TaskSpec) -> None:
        # Job groups are per thread (pinned thread mode), so set it on the thread that runs the job.
        self.sc.setJobGroup(self.group, f"nbdist training ({len(self.workers)} workers)", interruptOnCancel=True)
        try:
            results = rdd.barrier().mapPartitions(functools.partial(run_task, spec)).collect()
        except Exception as exc:
            self.job_error = summarize_spark_error(exc)
            if not self._closed.is_set():
                log.warning("Spark job %s failed: %s", self.group, self.job_error)
            for w in self.workers:
                if w.code is None:  # the task ended without reporting: its process went with it
                    w.spark_error = self.job_error
                    w.log = (w.log + "\n" if w.log else "") + f"Spark job failed: {self.job_error}"
                    w.code = 1
            return
        for result in results:  # in case a task's report did not arrive
            w = self.workers[int(result["rank"])]
            if w.code is None:
                w.code, w.log = int(result["code"]), str(result.get("log", ""))

    # -- reports from the tasks -------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True, name="nbdist-spark-report").start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            channel = protocol.server_handshake(sock, self._secret)
        except Exception as exc:
            log.warning("rejected a status connection: %s", exc)
            sock.close()
            return
        try:
            while True:
                body = channel.recv().body
                rank = body.get("rank")
                if not isinstance(rank, int) or not 0 <= rank < len(self.workers):
                    continue
                w = self.workers[rank]
                if body.get("type") == "started":
                    w.pid, w.host = int(body["pid"]), str(body.get("host", ""))
                    w.warm = bool(body.get("warm"))
                    if w.warm:
                        log.info("worker %d: a warm worker on %s (pid %d)", rank, w.host, w.pid)
                elif body.get("type") == "exit":
                    w.log = str(body.get("log", ""))
                    w.code = int(body["code"])
        except Exception:
            pass
        finally:
            channel.close()

    # -- ending -------------------------------------------------------------
    def stop(self, grace: float = 3.0) -> None:
        """Let the tasks end by themselves (their workers exit when the coordinator closes), else cancel."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            thread.join(grace)
            if thread.is_alive():
                log.info("cancelling Spark job group %s", self.group)
                self._closed.set()
                self.sc.cancelJobGroup(self.group)
                thread.join(30.0)
                if thread.is_alive():
                    log.warning("Spark job group %s still running 30 s after cancelling", self.group)
        self._closed.set()
        if self._server is not None:
            try:
                self._server.close()
            except OSError:
                pass
