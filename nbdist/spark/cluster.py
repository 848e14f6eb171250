"""The Spark cluster as nbdist needs it: executors registered with enough slots, and a driver address they reach.

Two things Spark does not check for us before a job:
- Whether any executor is there at all. A row count or a barrier stage submitted to an
  application without executors waits forever (executors that cannot connect back to the driver
  never register, and Spark only logs "Initial job has not accepted any resources" on the driver).
  So nbdist waits a bounded time for them and then says why, naming ``spark.driver.host``. Under dynamic
  allocation executors come only for waiting tasks: a job then runs at once, and is cancelled with that
  sentence if still no executor registered after the same wait (``executors_for``).
- Which of the driver's addresses the executors reach. The coordinator listens on the address
  this machine uses on its route to the executors: that is the network they connect back through,
  whatever the driver's hostname resolves to (often 127.0.1.1 on Debian).
"""
from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from ..errors import NbdistError

log = logging.getLogger(__name__)

# How long to wait for executors before saying why there are none, by default (TrainConfig.executor_wait).
EXECUTOR_WAIT = 20.0
LOOPBACK = "127.0.0.1"
# The oldest Spark nbdist runs on: barrier stages of DataFrames (mapInArrow(barrier=True)) and job tags came in 3.5.
OLDEST_SPARK = (3, 5)


def check_spark_version(version: str) -> None:
    """Refuse, in one sentence, a PySpark older than ``OLDEST_SPARK`` (its ``__version__``, ``version``)."""
    if tuple(int(n) for n in re.findall(r"\d+", version)[:2]) < OLDEST_SPARK:
        raise NbdistError(f"nbdist runs on Spark 3.5 or later, and this notebook's PySpark is {version}; use a "
                          "Spark 3.5+ cluster and its PySpark (pip install 'pyspark>=3.5'), or train on arrays "
                          "with --backend local.")


@dataclass(frozen=True)
class Executors:
    count: int  # registered executors (not the driver)
    slots: int  # tasks they can run at once
    hosts: tuple[str, ...]  # their host names or addresses, as they registered


def is_connect_session(session: Any) -> bool:
    """A Spark Connect client session: no SparkContext, no RDDs."""
    return type(session).__module__.startswith("pyspark.sql.connect")


def is_local(master: str) -> bool:
    return master.startswith("local")


def registered(sc: Any) -> Executors:
    """The executors registered with the driver right now, from the JVM's scheduler."""
    jsc = sc._jsc.sc()
    count = int(jsc.getExecutorIds().size())
    try:  # tasks at once under the default resource profile (cores, spark.task.cpus, GPUs)
        slots = int(jsc.maxNumConcurrentTasks(jsc.resourceProfileManager().defaultResourceProfile()))
    except Exception:  # an internal API: fall back to cores / spark.task.cpus
        cpus = int(sc.getConf().get("spark.task.cpus", "1") or 1)
        slots = sc.defaultParallelism // max(1, cpus) if count else 0
    hosts: list[str] = []
    # The list holds the driver too, under spark.driver.host (an executor on the driver's machine may share
    # that name: leaving it out loses nothing, it reaches any address of this machine).
    driver = sc.getConf().get("spark.driver.host", None)
    try:
        for info in jsc.statusTracker().getExecutorInfos():
            if str(info.host()) != driver:
                hosts.append(str(info.host()))
    except Exception:
        log.debug("cannot list the executors' hosts", exc_info=True)
    return Executors(count, slots, tuple(sorted(set(hosts))))


def dynamic_allocation(conf: Callable[[str], str | None]) -> bool:
    """Whether Spark adds executors for waiting tasks and removes idle ones (``spark.dynamicAllocation.enabled``
    on a cluster manager: EMR's and Dataproc's default); a local master has no executors to add. ``conf``: a
    session's setting by name (None where unset)."""
    master = conf("spark.master") or ""
    return not is_local(master) and (conf("spark.dynamicAllocation.enabled") or "").strip().lower() == "true"


def allocation_ceiling(conf: Callable[[str], str | None]) -> int | None:
    """The most task slots dynamic allocation may reach (maxExecutors x spark.executor.cores / spark.task.cpus);
    None when either is unset (no bound nbdist can tell)."""
    most, cores = conf("spark.dynamicAllocation.maxExecutors"), conf("spark.executor.cores")
    if not most or not cores:
        return None
    cpus = max(1, int(conf("spark.task.cpus") or 1))
    return int(most) * int(cores) // cpus


def check_ceiling(conf: Callable[[str], str | None], slots: int) -> None:
    """One sentence when dynamic allocation can never give ``slots`` tasks a slot at once."""
    ceiling = allocation_ceiling(conf)
    if ceiling is not None and ceiling < slots:
        raise NbdistError(f"{slots} workers need {slots} Spark task slots at once but dynamic allocation stops at "
                          f"{conf('spark.dynamicAllocation.maxExecutors')} executors of "
                          f"{conf('spark.executor.cores')} cores ({ceiling} slots); use --workers "
                          f"{max(1, ceiling)} or fewer, or raise spark.dynamicAllocation.maxExecutors.")


def refuse_speculation(conf: Callable[[str], str | None]) -> None:
    """Workers in ordinary tasks (no barrier stage): Spark's speculation would start a copy of a slow one's task,
    which starts no worker and ends at once, and Spark would then kill the task that holds the worker."""
    if (conf("spark.speculation") or "").strip().lower() == "true":
        raise NbdistError("spark.speculation=true would start a second copy of a slow worker's Spark task and kill "
                          "the first when the copy ends; create the session with spark.speculation=false.")


def conf_of(sc: Any) -> Callable[[str], str | None]:
    """A classic session's setting by name (its master included), None where unset."""
    conf = sc.getConf()
    return lambda key: sc.master if key == "spark.master" else conf.get(key, None)


def wait_for_executors(sc: Any, slots: int, timeout: float = EXECUTOR_WAIT,
                       poll: float = 0.5) -> Executors | None:
    """Executors with at least ``slots`` task slots, waiting up to ``timeout`` s; None for a local master.
    Under dynamic allocation the executors registered now, at once (Spark adds more for waiting tasks), once
    the slots are within what it may allocate (``check_ceiling``).

    Raises NbdistError with one sentence when they are not there in time.
    """
    conf = sc.getConf()
    if is_local(sc.master):
        return None
    settings = conf_of(sc)
    if dynamic_allocation(settings):
        check_ceiling(settings, slots)
        return registered(sc)
    deadline = time.monotonic() + timeout
    while True:
        found = registered(sc)
        if found.slots >= slots:
            return found
        if time.monotonic() >= deadline:
            break
        time.sleep(poll)
    if found.count == 0:
        raise NbdistError(no_executors_message(sc.master, conf.get("spark.driver.host", None), timeout))
    raise NbdistError(f"{slots} workers need {slots} Spark task slots at once (barrier mode) but the "
                      f"{found.count} registered executor(s) offer {found.slots} after {timeout:.0f} s; "
                      f"use --workers {max(1, found.slots)} or fewer, or give the application more executors "
                      "or cores.")


@contextlib.contextmanager
def executors_for(sc: Any, timeout: float = EXECUTOR_WAIT) -> Iterator[None]:
    """Around small jobs of this thread (a row count, one row, an aggregate; classic sessions; None: Connect, the
    server's business): an executor to run them, waited for up to ``timeout`` s before they start; under
    dynamic allocation, which adds executors only for waiting tasks, they start at once and are cancelled if
    no executor registered within ``timeout`` s. Either way a missing executor is ``no_executors_message``."""
    if sc is None or is_local(sc.master):
        yield
        return
    if not dynamic_allocation(conf_of(sc)):
        wait_for_executors(sc, 1, timeout)
        yield
        return
    tag, done, gave_up = f"nbdist-wait-{uuid.uuid4().hex[:12]}", threading.Event(), threading.Event()

    def watch() -> None:
        if not done.wait(timeout) and registered(sc).count == 0:
            gave_up.set()
            sc.cancelJobsWithTag(tag)

    sc.addJobTag(tag)  # this thread's jobs from now on
    threading.Thread(target=watch, name="nbdist-executor-wait", daemon=True).start()
    try:
        yield
    except Exception:
        if gave_up.is_set():
            raise NbdistError(no_executors_message(sc.master, sc.getConf().get("spark.driver.host", None),
                                                   timeout)) from None
        raise
    finally:
        done.set()
        sc.removeJobTag(tag)


def dataframe_context(df: Any) -> Any:
    """The SparkContext behind ``df``'s session; None over Connect (its executors are the server's business)."""
    session = df.sparkSession
    return None if is_connect_session(session) else session.sparkContext


def no_executors_message(master: str, driver_host: str | None, waited: float,
                         resolve: Callable[[str], str] = socket.gethostbyname) -> str:
    """One sentence for an application without executors: why, and which setting to change."""
    head = f"no Spark executor registered with this notebook's driver within {waited:.0f} s (master {master})"
    shown = driver_host or socket.gethostname()
    ip = _resolve(shown, resolve)
    if ip is not None and ip.startswith("127."):
        return (f"{head}: spark.driver.host is {shown!r}, which is loopback ({ip}) on this machine, so executors "
                "elsewhere cannot connect back; set spark.driver.host (and spark.driver.bindAddress) to an "
                "address of this machine they can reach when creating the session.")
    toward = master_route_source(master, resolve)
    if toward is not None and ip is not None and toward != ip:
        return (f"{head}: executors connect back to spark.driver.host={shown!r} ({ip}) but this machine reaches "
                f"the master from {toward}, so they probably cannot reach the driver; set spark.driver.host "
                f"(and spark.driver.bindAddress) to {toward} when creating the session.")
    return (f"{head}: either the cluster has no free cores or memory for this application (compare "
            "spark.executor.cores and spark.executor.memory with what its workers offer, and look for other "
            f"applications holding them) or the executors cannot connect back to spark.driver.host={shown!r}.")


def _resolve(host: str, resolve: Callable[[str], str]) -> str | None:
    try:
        return resolve(host)
    except OSError:
        return None


def route_source(address: str) -> str | None:
    """This machine's address on its route to ``address`` (an IPv4 address); None if there is no route.

    A UDP socket's connect only asks the kernel for a route: no packet is sent.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, 9))
            return str(s.getsockname()[0])
        except OSError:
            return None


def master_route_source(master: str, resolve: Callable[[str], str] = socket.gethostbyname) -> str | None:
    """The address this machine uses toward a standalone master (spark://host:port); None for other masters."""
    if not master.startswith("spark://"):
        return None
    first = master[len("spark://"):].split(",")[0]  # HA masters: spark://a:7077,b:7077
    host = urlparse(f"spark://{first}").hostname
    ip = _resolve(host, resolve) if host else None
    return route_source(ip) if ip else None


def coordinator_host(sc: Any, executors: Executors | None,
                     resolve: Callable[[str], str] = socket.gethostbyname) -> str:
    """Where the coordinator listens and what the workers connect to.

    Loopback for a local master. Otherwise the driver's address on its route to the executors;
    when that cannot be found, the address spark.driver.host resolves to.
    """
    if is_local(sc.master):
        return LOOPBACK
    sources = set()
    for host in executors.hosts if executors is not None else ():
        ip = _resolve(host, resolve)
        source = route_source(ip) if ip else None
        if source is not None:
            sources.add(source)
    if len(sources) == 1:
        return sources.pop()
    if len(sources) > 1:  # executors on several networks: the one spark.driver.host names, if it is among them
        log.info("the executors are reached from several addresses of this machine: %s", sorted(sources))
    shown = sc.getConf().get("spark.driver.host", None) or socket.gethostname()
    ip = _resolve(shown, resolve) or shown
    if sources and ip not in sources:
        return sorted(sources)[0]
    return LOOPBACK if ip.startswith("127.") else ip


UNREACHABLE_HINT = ("set spark.driver.host (and spark.driver.bindAddress) to an address of the notebook's machine "
                    "that the executors can reach")

CANNOT_IMPORT = "the executors cannot import "  # how python_hint's sentence begins


def cannot_import(error: str) -> bool:
    """Whether a Spark job's summarised error is ``python_hint``'s: a task's Python raised, no process died."""
    return error.startswith(CANNOT_IMPORT)


def python_hint(module: str) -> str:
    """The sentence for a Spark task whose Python could not import ``module`` (nbdist, or one it needs):
    the executors' interpreter is another environment than the notebook's."""
    ship = " (or ship nbdist with sc.addPyFile)" if module == "nbdist" else ""
    return (f"{CANNOT_IMPORT}{module}: they run the Python named by PYSPARK_PYTHON in the notebook's environment "
            "when the session was created (spark.pyspark.python is ignored for a session created from Python); set "
            "os.environ['PYSPARK_PYTHON'] to a Python with nbdist and its requirements that exists at the same path "
            f"on every executor machine before creating the session{ship}.")
