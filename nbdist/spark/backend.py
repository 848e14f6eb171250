"""Spark backend: workers are barrier tasks of the notebook's SparkSession, classic or Spark Connect.

One launcher serves both: the barrier stage is ``df.mapInArrow(arrow_task, schema, barrier=True)`` over the
training DataFrame (one partition per worker, rebalanced into equal shares: balance.py) or over ``spark.range``
when the data travels over the wire; an RDD of pairs (classic only) runs as ``rdd.barrier().mapPartitions``.
Under dynamic allocation, which refuses barrier stages, it is an ordinary stage (Spark adds executors for its
waiting tasks; a retried task starts no worker). A background thread ``collect()``s the stage under a tag of its
own, so stopping the run cancels exactly its tasks. Each task starts the worker program and reports its rows, its
process and how it ended over an authenticated side channel. An elastic run (``workers="MIN:MAX"``, classic, data
over the wire: docs/elastic.md) runs each worker as a Spark job of one ordinary task under the run's job tag: a
lost task fails only its own job; jobs beyond the free slots, and replacements (``add_worker``), wait for a slot
and join at the members' first commit after they connected.
"""
from __future__ import annotations

import functools
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import TrainConfig
from ..errors import NbdistError
from ..machine.keras_backend import notebook_backend
from ..machine.processes import ChildEnd
from ..wire import protocol
from ..wire.catalog import read
from ..wire.reports import TaskExit, TaskRows, TaskStarted
from . import cluster
from .balance import Rebalance, rebalance_frame, rebalance_rdd, rebalance_with_validation
from .data import SparkData, barrier_safe
from .task import RESULT_SCHEMA, TaskSpec, arrow_task, run_task, single_task

log = logging.getLogger(__name__)

# How a lost ordinary task is said (failures.describe_exit): an elastic run's, or one under dynamic allocation.
TASK_LOST = "was lost with its Spark task (its executor or the task's Python process died)"

# Spark's status store (AppStatusListener) flushes live counts at least every spark.ui.liveUpdate.minFlushPeriod
# (1 s): read that long, this many times, for the free task slots of a relaunch.
STATUS_FLUSH, STATUS_READS = 1.5, 7
# How long a job message waits for its worker's task to say it started (and with what thread budget).
REPORT_WAIT = 2.0

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


def active_spark_session() -> Any | None:
    """The notebook's SparkSession: a Spark Connect client's, else a classic one with a running context.

    A Connect session comes first: ``SparkSession.builder.remote("local[2]")`` runs its server's
    SparkContext in this very process, yet the notebook's ``spark`` is the Connect client.
    """
    if "pyspark" not in sys.modules:
        return None
    if "pyspark.sql.connect.session" in sys.modules:
        from pyspark.sql.connect.session import SparkSession as ConnectSession

        session = ConnectSession.getActiveSession() or ConnectSession._get_default_session()
        if session is not None:
            return session
    sc = active_spark_context()
    if sc is None:
        return None
    from pyspark.sql import SparkSession

    # The context's own session; never the builder, which may hand out a Connect session (SPARK_REMOTE).
    return SparkSession.getActiveSession() or SparkSession._instantiatedSession or SparkSession(sc)


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


def route_to(host: str, resolve: Callable[[str], str] = socket.gethostbyname) -> str:
    """This machine's address on the way to ``host`` (a Connect server): loopback for a local server."""
    try:
        ip = resolve(host)
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    if ip.startswith("127.") or ip == "::1":
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((ip, 15002))  # UDP: picks the route, sends nothing
        return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
    finally:
        probe.close()


def session_hosts(session: Any, advertise: str | None = None,
                  executors: cluster.Executors | None = None) -> tuple[str, str]:
    """(bind, advertise) for the coordinator and status listener of a run on ``session``.

    ``advertise`` (TrainConfig.advertise_host) names the notebook's address as executors see it (a NAT, a
    VPN): the listeners then bind every interface. Otherwise a classic session uses the driver's address on
    its route to the ``executors`` (cluster.coordinator_host) and a Connect client the address of its
    route to the Connect server.
    """
    if advertise:
        return "0.0.0.0", advertise
    if cluster.is_connect_session(session):
        host = route_to(session.client.host)
    else:
        host = cluster.coordinator_host(session.sparkContext, executors)
    return host, host


def task_slots(sc: Any) -> int:
    """How many tasks can run at once, which a barrier stage needs for all its tasks."""
    cpus = int(sc.getConf().get("spark.task.cpus", "1") or 1)
    return max(1, sc.defaultParallelism // max(1, cpus))


def connect_slots(conf: Callable[[str], str | None]) -> int:
    """Task slots as a Connect client can tell them from the server's configuration (it has no
    SparkContext to ask): the default parallelism, else local[N] or executors x cores."""
    cpus = max(1, int(conf("spark.task.cpus") or 1))
    parallelism = conf("spark.default.parallelism")
    if parallelism:
        return max(1, int(parallelism) // cpus)
    master = conf("spark.master") or ""
    if master.startswith("local"):
        inner = (master[master.find("[") + 1:master.find("]")] if "[" in master else "1").split(",")[0].strip()
        n = (os.cpu_count() or 1) if inner == "*" else int(inner)
        return max(1, n // cpus)
    instances, cores = conf("spark.executor.instances"), conf("spark.executor.cores")
    if instances and cores:
        return max(1, int(instances) * int(cores) // cpus)
    return 2


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
    missing = re.search(r"No module named '([\w.]+)'", text)
    if missing:  # the task's Python raised before any worker started: its interpreter lacks a package
        return cluster.python_hint(missing.group(1).split(".")[0])
    for line in text.splitlines():
        line = line.strip()
        if line:
            return line[:500]
    return type(exc).__name__


def failed_barrier_task(job_error: str) -> int | None:
    """The partition (a worker's rank) of the barrier task whose failure aborted the stage, as Spark's
    message names it ("... because barrier task ResultTask(10, 1) finished unsuccessfully"); None if not."""
    found = re.search(r"barrier task ResultTask\(\d+, (\d+)\)", job_error or "")
    return int(found.group(1)) if found else None


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
        self.error = ""  # the task's own sentence, e.g. that it cannot reach the notebook
        self.rows: int | None = None  # the rows of its partition, as the task counted them
        self.end: ChildEnd | None = None  # its exit, peak memory and whether the OOM killer ended it
        # Its task ended without reporting while the Spark job failed (its Python process or executor died):
        # Spark never retries a barrier ResultStage, so the run ends here unless it relaunches (--max-restarts).
        self.lost = False
        self.lost_why = ""  # an elastic run's words for that loss (failures.describe_exit)
        # An elastic run's worker whose job waits for a task slot (beyond the launch's free slots, or a
        # replacement): why. The run does not wait for it; it joins if its task starts.
        self.unplaced = ""
        self.check_lost: Callable[[], bool] | None = None  # an elastic run's: asks Spark whether its task failed
        # Under dynamic allocation: what it means when its task never starts (Spark found it no slot).
        self.unstarted = ""
        self.threads = 0  # the thread budget its task gave it (a cluster's: the task's CPUs); 0: not said
        self._checked_at = 0.0

    def told_threads(self, wait: float = REPORT_WAIT) -> int:
        """The thread budget its task gave it (0: not said; the driver then uses this machine's share), once the
        task's ``TaskStarted`` is here: a warm worker may connect before it, so it is waited for, up to ``wait`` s."""
        deadline = time.monotonic() + wait
        while self.pid is None and self.code is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.threads

    def exit_status(self) -> int | None:
        if self.code is None and self.check_lost is not None and time.monotonic() - self._checked_at > 1.0 \
                and self._check_lost():
            self.mark_lost()
        return self.code

    def mark_lost(self, lost: bool = True) -> None:
        """The worker of an ordinary task (elastic, or under dynamic allocation) ended with its task, unreported
        (``lost``: not by the run's own stop)."""
        self.lost, self.lost_why, self.code = lost, TASK_LOST, 1

    def _check_lost(self) -> bool:
        self._checked_at = time.monotonic()
        return self.check_lost()

    def settle(self, timeout: float) -> int | None:
        """The exit status once Spark knows how this worker's task ended, waiting up to ``timeout`` s: its
        connection closed before its task's end was reported (an executor lost, seen by Spark a moment later).
        An elastic run's worker only; another's is returned as it is."""
        deadline = time.monotonic() + timeout
        while self.check_lost is not None and self.exit_status() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.code

    def describe(self) -> str:
        where = f", pid {self.pid} on {self.host}" if self.pid else ""
        why = f"; its Spark job failed: {self.spark_error}" if self.spark_error and not self.lost else ""
        why = f": {self.error}" if self.error else why
        why = f"; {self.unstarted}" if self.unstarted and self.pid is None and not why else why
        return f"worker {self.rank} (Spark task {self.rank}{where}{why})"

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log.splitlines()[-lines:])


@dataclass(frozen=True)
class Balanced:
    """The training data as the barrier stage reads it: one partition per worker."""

    dataframe: Any = None
    rdd: Any = None  # an RDD of pairs (classic sessions)


class SparkBackend:
    name = "spark"
    store_on_link = True  # rank 0 binds the rendezvous store on its own executor, not the driver's host

    def __init__(self, session: Any, config: TrainConfig | None = None) -> None:
        import pyspark

        cluster.check_spark_version(pyspark.__version__)
        self.session = session
        config = config or TrainConfig()
        # The run's choices for Spark (TrainConfig): how long to wait for executors, the address they reach
        # the notebook at, and whether they keep warm workers.
        self.executor_wait, self.warm = config.executor_wait, config.warm_workers
        self.connect = cluster.is_connect_session(session)
        # An elastic run (classic sessions; training.py refuses it over Connect): one job per worker, launched
        # on as many task slots as exist (at least min_workers).
        self.elastic, self.min_workers = config.elastic and not self.connect, config.min_workers or 1
        self.startup_timeout = config.startup_timeout
        # Under dynamic allocation Spark refuses barrier stages: the workers' stage is an ordinary one.
        self._conf = cluster.conf_of(session.sparkContext) if not self.connect else (
            lambda key: session.conf.get(key, None))
        self.barrier = not cluster.dynamic_allocation(self._conf)
        if self.elastic or not self.barrier:
            cluster.refuse_speculation(self._conf)
        # Classic sessions, before any Spark job: executors registered, and the address they reach us at.
        self.executors = None if self.connect else cluster.wait_for_executors(session.sparkContext, 1,
                                                                              self.executor_wait)
        self.bind_host, self.advertise_host = session_hosts(session, config.advertise_host, self.executors)
        self.unreachable_hint = cluster.UNREACHABLE_HINT
        self.gloo_ifname: str | None = "lo" if self.advertise_host == "127.0.0.1" else None
        self.group = f"nbdist-{uuid.uuid4().hex[:12]}"  # the job group (classic) or operation tag (Connect)
        self.workers: list[SparkTaskWorker] = []
        self.job_error: str | None = None
        self._thread: threading.Thread | None = None
        self._threads: list[threading.Thread] = []  # an elastic run's: one per worker's job
        self._withdrawn: set[int] = set()  # an elastic run's jobs cancelled before their task started (stop)
        self._spec: TaskSpec | None = None
        self._status_address: tuple[str, int] = ("", 0)
        self._server: socket.socket | None = None
        self._closed = threading.Event()
        self._secret = b""
        self.rebalance: Rebalance | None = None  # what the last launch found in the data's partitions

    def default_workers(self) -> int:
        if self.connect:
            return connect_slots(self._conf)
        if self.executors is not None:  # a cluster: the slots of the executors registered now
            slots = cluster.registered(self.session.sparkContext).slots
            if self.barrier:
                return max(1, slots)
            # Dynamic allocation adds executors for waiting tasks: at least 2, within what it may allocate.
            wanted, ceiling = max(2, slots), cluster.allocation_ceiling(self._conf)
            return wanted if ceiling is None else max(1, min(wanted, ceiling))
        return task_slots(self.session.sparkContext)

    def free_slots(self) -> int | None:
        """Task slots no job holds now: what a relaunch asks for at most (training.py). The slots of the
        executors registered now, less the tasks they run; over Connect, the server's configuration's; under
        dynamic allocation, which adds executors for waiting tasks, what it may allocate (None: no bound known)."""
        if not self.barrier:
            return cluster.allocation_ceiling(self._conf)
        slots = self.default_workers()
        if self.connect:
            return slots
        # The tasks of the stages running now (a cancelled run's tasks, still being killed, are not theirs).
        # Spark's status store writes a busy stage's count about once a second: the lowest count read over a
        # little longer than that.
        running = slots
        tracker = self.session.sparkContext.statusTracker()
        for _ in range(STATUS_READS):
            try:
                stages = [tracker.getStageInfo(s) for s in tracker.getActiveStageIds()]
                running = min(running, sum(s.numActiveTasks for s in stages if s is not None))
            except Exception:  # a session stopped meanwhile: count every slot as free
                return slots
            if running == 0:
                break
            time.sleep(STATUS_FLUSH / (STATUS_READS - 1))
        return max(0, slots - running)

    def _task_threads(self, share: int) -> int:
        """A worker's thread budget as its task is told it: ``share`` of this machine's cores on a local master
        (the tasks run here), else 0: the task's own CPUs (``spark.task.cpus``, what Spark reserved for it on
        its executor), which it reports (``SparkTaskWorker.threads``) for the job message."""
        return share if cluster.is_local(self._conf("spark.master") or "local") else 0

    def partition_rows(self) -> list[int] | None:
        """Each task's row count once every task has written its partition, else None."""
        rows = [w.rows for w in self.workers]
        return None if not rows or any(r is None for r in rows) else [int(r) for r in rows]

    def launch(self, world_size: int, address: tuple[str, int], secret: bytes, threads_per_worker: int,
               data: SparkData | None = None) -> list[SparkTaskWorker]:
        """``data``: a DataFrame or RDD read where it lives, one partition per task; None: the
        data travels over the wire and the tasks only host the workers."""
        if self.elastic:
            return self._launch_elastic(world_size, address, secret, threads_per_worker, data)
        if self.connect and data is not None and data.dataframe is None:
            raise NbdistError("RDDs do not exist over Spark Connect; pass a DataFrame instead, e.g. "
                              "spark.createDataFrame(pandas_df), naming its columns with --features and --label.")
        if self.executors is not None:  # one sentence within seconds, rather than Spark's wait for slots
            cluster.wait_for_executors(self.session.sparkContext, world_size, self.executor_wait)
        slots = self.default_workers()
        if world_size > slots and not self.connect and self.barrier:  # Connect: the server's conf is only a guess
            raise NbdistError(f"{world_size} workers need {world_size} Spark task slots at once (barrier mode) "
                              f"but this SparkContext has {slots}; use --workers {slots} or fewer.")
        if not self.barrier:
            cluster.check_ceiling(self._conf, world_size)
        # Before the status listener starts: the counting job may end in an interrupt.
        if data is not None:
            with cluster.executors_for(None if self.connect else self.session.sparkContext, self.executor_wait):
                source = self._balanced(world_size, data)
        else:
            source = None
        self._secret = secret
        self.workers = [SparkTaskWorker(r) for r in range(world_size)]
        for w in self.workers if not self.barrier else ():
            w.unstarted = ("its task got no slot: under dynamic allocation Spark adds executors for waiting tasks "
                           "only as far as the cluster has room and spark.dynamicAllocation.maxExecutors allows")
        self._listen()
        spec = TaskSpec(address=tuple(address), status_address=self._status_address, secret_hex=secret.hex(),
                        threads=self._task_threads(threads_per_worker), layout=None if data is None else data.layout,
                        warm=self.warm,  # TrainConfig.warm_workers=False turns executors' warm workers off
                        keras_backend=notebook_backend(),
                        validation=data is not None and data.validation is not None, barrier=self.barrier)
        stage = self._stage(world_size, source, spec)
        self._thread = threading.Thread(target=self._run, args=(stage,), name="nbdist-spark-job", daemon=True)
        self._thread.start()
        log.info("started Spark job %s with %d %s tasks%s", self.group, world_size,
                 "barrier" if self.barrier else "ordinary (dynamic allocation)",
                 " over Spark Connect" if self.connect else "")
        return list(self.workers)

    # -- an elastic run: one Spark job of one task per worker ------------------
    def _launch_elastic(self, world_size: int, address: tuple[str, int], secret: bytes, threads_per_worker: int,
                        data: SparkData | None) -> list[SparkTaskWorker]:
        """Each worker a job of its own (``submit``), on the task slots free now: a lost task fails its own
        job, not its peers'. Workers beyond them are ``unplaced``: their jobs wait for a slot (``_submit_unplaced``)."""
        if data is not None:
            raise NbdistError("an elastic run (--workers MIN:MAX) on Spark trains on data sent from the notebook, "
                              "since a survivor cannot read a lost task's partition; pass numpy arrays or pandas "
                              "(df.toPandas()), or give --workers a single number to train on the DataFrame.")
        if self.executors is not None:  # a cluster: at least MIN slots, within executor_wait
            cluster.wait_for_executors(self.session.sparkContext, self.min_workers, self.executor_wait)
        free = self.free_slots()  # None: dynamic allocation, no bound known (Spark adds executors)
        slots = world_size if free is None else free
        if slots < self.min_workers:
            raise NbdistError(f"--workers {self.min_workers}:{world_size} needs at least {self.min_workers} free Spark "
                              f"task slots but this SparkContext has {slots} free now; lower MIN to {max(1, slots)} "
                              "or wait for the jobs that hold them.")
        self._secret = secret
        self.workers = [SparkTaskWorker(r) for r in range(world_size)]
        self._listen()
        self._spec = TaskSpec(address=tuple(address), status_address=self._status_address, secret_hex=secret.hex(),
                              threads=self._task_threads(threads_per_worker), warm=self.warm,
                              keras_backend=notebook_backend())
        for w in self.workers[slots:]:
            w.unplaced = f"found no free Spark task slot ({slots} were free; it joins when it gets one)"
        placed = min(slots, world_size)
        for rank in range(placed):
            self.submit(rank)
        if placed < world_size:  # once the placed tasks run, so that theirs are the slots free now
            threading.Thread(target=self._submit_unplaced, args=(placed, world_size), daemon=True,
                             name="nbdist-spark-unplaced").start()
        log.info("started %d Spark jobs of one task each (elastic, job tag %s)", placed, self.group)
        return list(self.workers)

    def _submit_unplaced(self, placed: int, world_size: int) -> None:
        """The jobs of the launch's workers that found no free slot, submitted once the placed workers' tasks
        started (or ``startup_timeout`` passed): they wait for a slot (an executor added, a job ending) until the
        run ends. The first generation forms without them; one that starts joins at the next commit."""
        deadline = time.monotonic() + self.startup_timeout
        while any(w.pid is None and w.code is None for w in self.workers[:placed]) \
                and time.monotonic() < deadline and not self._closed.is_set():
            time.sleep(0.2)
        for rank in range(placed, world_size):
            if not self._closed.is_set():
                self.submit(rank)

    def add_worker(self, rank: int, like: int, address: tuple[str, int], secret: bytes) -> SparkTaskWorker:
        """One more worker, ``rank``, in lost worker ``like``'s place (an elastic run's replacement,
        driver/training.py): its job, of one task, waits for a free task slot until the run ends (the lost task's
        slot, when its executor lives; else an executor Spark adds). ``unplaced``: the members do not wait for it;
        it joins at their first commit after it connected. Spark picks the slot, and the task its GPU."""
        self.workers.append(SparkTaskWorker(rank))
        self.workers[rank].unplaced = f"waits for a free Spark task slot in worker {like}'s place"
        self.submit(rank)
        return self.workers[rank]

    def remove_worker(self, rank: int) -> None:
        """Cancel worker ``rank``'s job, which an elastic run went on without (it went silent: its executor may be
        cut off, and Spark kills the task if it can still reach it). Its end is no news any more."""
        self._withdrawn.add(rank)
        self.session.sparkContext.cancelJobGroup(f"{self.group}-{rank}")

    def submit(self, rank: int) -> None:
        """Start worker ``rank``'s job: one task on a free slot (it waits for one until it gets one or the run
        ends)."""
        w = self.workers[rank]
        w.check_lost = functools.partial(self._task_failed, rank)
        job = self.session.sparkContext.parallelize([rank], 1).mapPartitions(
            functools.partial(single_task, self._spec, rank)).collect
        thread = threading.Thread(target=self._run_one, args=(rank, job), name=f"nbdist-spark-job-{rank}",
                                  daemon=True)
        self._threads.append(thread)
        thread.start()

    def _run_one(self, rank: int, job: Callable[[], list[Any]]) -> None:
        sc = self.session.sparkContext
        sc.setJobGroup(f"{self.group}-{rank}", f"nbdist worker {rank} (elastic)", interruptOnCancel=True)
        sc.addJobTag(self.group)  # the run's: stop() cancels every worker's job at once
        w = self.workers[rank]
        try:
            results = job()
        except Exception as exc:
            error = summarize_spark_error(exc)
            if w.code is None:  # its task ended without reporting: its worker went with it
                w.spark_error = error
                if cluster.cannot_import(error):  # its Python raised: said in full, never relaunched
                    w.code = 1
                else:
                    w.mark_lost(not self._closed.is_set() and rank not in self._withdrawn)
            return
        finally:
            sc.removeJobTag(self.group)
        for result in results:
            if w.code is None:  # a retry after its first attempt was lost (single_task starts no worker then)
                w.error = str(result.get("error") or "")
                w.lost, w.lost_why = bool(result.get("lost")), TASK_LOST
                w.code, w.log = int(result["code"]), str(result.get("log") or "")

    def _task_failed(self, rank: int) -> bool:
        """Whether worker ``rank``'s job has a failed task (its executor lost: Spark retries it, and the retry
        starts no worker). Then the job is cancelled, so the retry does not wait for a slot."""
        try:
            tracker = self.session.sparkContext.statusTracker()
            for job_id in tracker.getJobIdsForGroup(f"{self.group}-{rank}"):
                info = tracker.getJobInfo(job_id)
                for stage_id in (info.stageIds if info is not None else []):
                    stage = tracker.getStageInfo(stage_id)
                    if stage is not None and stage.numFailedTasks > 0:
                        self.session.sparkContext.cancelJobGroup(f"{self.group}-{rank}")
                        return True
        except Exception as exc:  # a stopped session: its tasks went with it
            log.debug("cannot read Spark's status of worker %d: %s", rank, exc)
        return False

    @property
    def data_note(self) -> str:
        """How the last launch rebalanced its data, for the run's first line ('' when it did not)."""
        return self.rebalance.note if self.rebalance is not None else ""

    def _balanced(self, world_size: int, data: SparkData) -> Balanced:
        """The data as one partition per worker with equal shares (balance.py): counted in one job, then
        read as it is when its partitions already give equal shares, else routed by global row index."""
        if data.dataframe is None:  # an RDD of pairs: classic sessions only
            rdd, self.rebalance = rebalance_rdd(data.rdd, world_size, data.batch,
                                                must_shuffle=not barrier_safe(data.rdd._jrdd.rdd()))
            return Balanced(rdd=rdd)
        df = data.dataframe
        if data.validation is None:
            # Connect cannot see partitions, so it always shuffles; classic keeps barrier-safe partitions.
            must = self.connect or not barrier_safe(df._jdf.rdd())
            partitions = None if self.connect else df._jdf.rdd().getNumPartitions()
            df, self.rebalance = rebalance_frame(df, world_size, data.batch, partitions, must)
            return Balanced(dataframe=df)
        df, self.rebalance = rebalance_with_validation(df, data.validation, world_size, data.batch, self.connect)
        return Balanced(dataframe=df)

    def _stage(self, world_size: int, data: Balanced | None, spec: TaskSpec) -> Callable[[], list[Any]]:
        """The barrier stage (an ordinary one under dynamic allocation), as a function that runs it and returns
        one result per task."""
        if data is not None and data.rdd is not None:  # an RDD of pairs: classic sessions only
            rdd = data.rdd.barrier() if spec.barrier else data.rdd
            return rdd.mapPartitions(functools.partial(run_task, spec)).collect
        if data is None:  # numpy/pandas data travels over the wire; the tasks only host the workers
            df = self.session.range(world_size, numPartitions=world_size)
        else:
            df = data.dataframe
        return df.mapInArrow(functools.partial(arrow_task, spec), RESULT_SCHEMA, barrier=spec.barrier).collect

    def _run(self, stage: Callable[[], list[Any]]) -> None:
        # Job groups and tags are per thread, so set them on the thread that runs the job.
        if self.connect:
            self.session.addTag(self.group)
        else:
            self.session.sparkContext.setJobGroup(self.group, f"nbdist ({len(self.workers)} workers)",
                                                  interruptOnCancel=True)
        try:
            results = stage()
        except Exception as exc:
            self.job_error = summarize_spark_error(exc)
            if not self._closed.is_set():
                log.warning("Spark job %s failed: %s", self.group, self.job_error)
            failed = failed_barrier_task(self.job_error)
            raised = cluster.cannot_import(self.job_error)  # said in full, not a loss to relaunch
            for w in self.workers:
                if w.code is None:  # the task ended without reporting: its process went with it
                    # Not cancelled by this run's own ending, and the task Spark names as the one that
                    # failed (its peers' tasks were then cancelled with the stage), when it names one.
                    w.lost = not (self._closed.is_set() or raised) and failed in (None, w.rank)
                    w.spark_error = self.job_error
                    w.log = (w.log + "\n" if w.log else "") + f"Spark job failed: {self.job_error}"
                    w.code = 1
            return
        finally:
            if self.connect:
                self.session.removeTag(self.group)
        for result in results:  # what the status channel did not bring (a task that could not reach it)
            result = result.asDict() if hasattr(result, "asDict") else dict(result)
            w = self.workers[int(result["rank"])]
            if result.get("error"):
                w.error = str(result["error"])
            if w.code is None:
                w.code, w.log = int(result["code"]), str(result.get("log") or "")

    # -- reports from the tasks -------------------------------------------
    def _listen(self) -> None:
        """The status listener the tasks report to (``_status_address``)."""
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.bind((self.bind_host, 0))
        self._server.listen(64)
        self._status_address = (self.advertise_host, self._server.getsockname()[1])
        threading.Thread(target=self._accept, name="nbdist-spark-status", daemon=True).start()

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
        w: SparkTaskWorker | None = None
        try:
            while True:
                msg = read(channel.recv())  # a malformed message ends this task's channel, as garbage does
                if not isinstance(msg, (TaskStarted, TaskRows, TaskExit)) or not 0 <= msg.rank < len(self.workers):
                    continue
                w = self.workers[msg.rank]
                if isinstance(msg, TaskStarted):
                    w.pid, w.host, w.warm, w.threads = msg.pid, msg.host, msg.warm, msg.threads
                    if w.warm:
                        log.info("worker %d: a warm worker on %s (pid %d)", msg.rank, w.host, w.pid)
                elif isinstance(msg, TaskRows):
                    w.rows = msg.rows
                else:
                    w.log = msg.log
                    if msg.error:
                        w.error = msg.error
                    if msg.peak_rss is not None:  # how it ended, as its task saw it (procs.reap)
                        w.end = ChildEnd(msg.code, msg.peak_rss, msg.oom_killed)
                    w.code = msg.code
        except Exception:
            pass
        finally:
            channel.close()
        if (self.elastic or not self.barrier) and w is not None and w.code is None and w.pid is not None \
                and not self._closed.is_set() and w.rank not in self._withdrawn:
            # An ordinary task whose channel closed before it said how its worker ended: its Python process died
            # (killed, or its executor gone), and its worker with it. Known now, before Spark's own news (a
            # barrier stage's failure ends its job, which says so).
            w.mark_lost()

    # -- ending -------------------------------------------------------------
    def cleanup(self) -> None:
        """Nothing to remove on the driver: each task removes its own files on its executor."""

    def cancel(self) -> None:
        """Cancel this run's Spark job: its operation tag over Connect, its job group on a classic session."""
        try:
            if self.connect:
                self.session.interruptTag(self.group)
            elif self.elastic:
                self.session.sparkContext.cancelJobsWithTag(self.group)
            else:
                self.session.sparkContext.cancelJobGroup(self.group)
        except Exception as exc:  # a session stopped meanwhile: its tasks went with it
            log.warning("could not cancel Spark job %s: %s", self.group, exc)

    def _ended_in_status(self, timeout: float = 5.0) -> None:
        """Wait until Spark's status shows this run's jobs ended (its listener lags the jobs' own end), so
        that what a relaunch reads of the free task slots (``free_slots``) no longer counts their tasks."""
        if self.connect or not self.workers:
            return
        groups = [f"{self.group}-{w.rank}" for w in self.workers] if self.elastic else [self.group]
        deadline = time.monotonic() + timeout
        try:
            tracker = self.session.sparkContext.statusTracker()
            while time.monotonic() < deadline:
                jobs = [tracker.getJobInfo(j) for g in groups for j in tracker.getJobIdsForGroup(g)]
                if not any(info is not None and info.status == "RUNNING" for info in jobs):
                    return
                time.sleep(0.1)
        except Exception as exc:  # a session stopped meanwhile: nothing of it runs
            log.debug("cannot read Spark's status of job %s: %s", self.group, exc)

    def stop(self, grace: float = 3.0) -> None:
        """Let the tasks end by themselves (their workers exit when the coordinator closes), else cancel."""
        if self.elastic:  # jobs still waiting for a slot hold no worker: cancelled at once
            for w in list(self.workers):
                if w.pid is None and w.code is None:
                    self._withdrawn.add(w.rank)
                    try:
                        self.session.sparkContext.cancelJobGroup(f"{self.group}-{w.rank}")
                    except Exception as exc:  # a stopped session: its jobs went with it
                        log.debug("could not cancel worker %d's Spark job: %s", w.rank, exc)
        threads = [t for t in [self._thread, *self._threads] if t is not None]
        if not _joined(threads, grace):
            log.info("cancelling Spark job %s", self.group)
            self._closed.set()
            self.cancel()
            if not _joined(threads, 30.0):
                log.warning("Spark job group %s still running 30 s after cancelling", self.group)
        self._closed.set()
        self._ended_in_status()
        if self._server is not None:
            try:
                self._server.close()
            except OSError:
                pass


def _joined(threads: list[threading.Thread], seconds: float) -> bool:
    """Join ``threads`` within ``seconds`` in all; whether every one ended."""
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)
