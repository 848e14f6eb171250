"""The Spark cluster as nbdist needs it: executors registered with enough slots, and a driver address they reach.

Two things Spark does not check for us before a job:
- Whether any executor is there at all. A row count or a barrier stage submitted to an
  application without executors waits forever (executors that cannot connect back to the driver
  never register, and Spark only logs "Initial job has not accepted any resources" on the driver).
  So nbdist waits a bounded time for them and then says why, naming ``spark.driver.host``.
- Which of the driver's addresses the executors reach. The coordinator listens on the address
  this machine uses on its route to the executors: that is the network they connect back through,
  whatever the driver's hostname resolves to (often 127.0.1.1 on Debian).
"""
from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

from ..errors import NbdistError

log = logging.getLogger(__name__)

# How long to wait for executors before saying why there are none, by default (TrainConfig.executor_wait).
EXECUTOR_WAIT = 20.0
LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class Executors:
    count: int  # registered executors (not the driver)
    slots: int  # tasks they can run at once
    hosts: tuple[str, ...]  # their host names or addresses, as they registered


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


def wait_for_executors(sc: Any, slots: int, timeout: float = EXECUTOR_WAIT,
                       poll: float = 0.5) -> Executors | None:
    """Executors with at least ``slots`` task slots, waiting up to ``timeout`` s; None for a local master.

    Raises NbdistError with one sentence when they are not there in time.
    """
    conf = sc.getConf()
    if is_local(sc.master):
        return None
    if (conf.get("spark.dynamicAllocation.enabled", "false") or "").lower() == "true":
        raise NbdistError("nbdist's workers run as one Spark barrier stage, which Spark refuses under dynamic "
                          "allocation; create the session with spark.dynamicAllocation.enabled=false and a "
                          "fixed number of executors (spark.executor.instances).")
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


def wait_for_dataframe_executors(df: Any, timeout: float = EXECUTOR_WAIT) -> None:
    """Before a small job on ``df`` (one row, an aggregate): an executor to run it (classic sessions)."""
    session = df.sparkSession
    if not type(session).__module__.startswith("pyspark.sql.connect"):  # Connect: the server's business
        wait_for_executors(session.sparkContext, 1, timeout)


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
