"""Choices for multi-machine runs without a cluster: the driver's address, the wait for executors, Gloo's interface.

The real thing runs in tests/spark/test_multihost.py (two hosts in network namespaces).
"""
from __future__ import annotations

import time

import pytest

from nbdist.errors import NbdistError
from nbdist.spark import cluster
from nbdist.strategies import collective


class _Seq:
    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


class _Info:
    def __init__(self, host: str, port: int) -> None:
        self._host, self._port = host, port

    def host(self) -> str:
        return self._host

    def port(self) -> int:
        return self._port


class _FakeJvmContext:
    """The few SparkContext (JVM) calls cluster.registered makes."""

    def __init__(self, hosts: list[str], driver: str, slots_each: int = 1) -> None:
        self.hosts, self.driver, self.slots_each = hosts, driver, slots_each

    def getExecutorIds(self):
        return _Seq(len(self.hosts))

    def resourceProfileManager(self):
        return self

    def defaultResourceProfile(self):
        return None

    def maxNumConcurrentTasks(self, profile):
        return self.slots_each * len(self.hosts)

    def statusTracker(self):
        return self

    def getExecutorInfos(self):
        driver = [_Info(self.driver, 5000)]  # the driver's own entry comes with the executors'
        return driver + [_Info(h, 7000 + i) for i, h in enumerate(self.hosts)]


class _FakeSc:
    def __init__(self, master: str, hosts: list[str], conf: dict[str, str] | None = None) -> None:
        self.master = master
        self.defaultParallelism = 2
        self._conf = {"spark.driver.host": "10.0.0.1", **(conf or {})}
        self._jsc = self
        self._jvm = _FakeJvmContext(hosts, self._conf["spark.driver.host"])

    def sc(self):
        return self._jvm

    def getConf(self):
        return self

    def get(self, key, default=None):
        return self._conf.get(key, default)


def test_registered_leaves_out_the_driver():
    found = cluster.registered(_FakeSc("spark://m:7077", ["hostA", "hostB"]))
    assert (found.count, found.slots, found.hosts) == (2, 2, ("hostA", "hostB"))


def test_no_wait_on_a_local_master():
    assert cluster.wait_for_executors(_FakeSc("local[2]", []), 2, timeout=5) is None


def test_no_executors_is_one_sentence_within_the_wait():
    sc = _FakeSc("spark://127.0.0.1:7077", [], {"spark.driver.host": "127.0.0.1"})
    start = time.monotonic()
    with pytest.raises(NbdistError) as err:
        cluster.wait_for_executors(sc, 2, timeout=0.3, poll=0.05)
    assert time.monotonic() - start < 2
    message = str(err.value)
    assert message.startswith("no Spark executor registered") and "spark.driver.host is '127.0.0.1'" in message
    assert "loopback" in message and ". " not in message  # one sentence


def test_too_few_slots_names_the_count():
    with pytest.raises(NbdistError, match="offer 1 .*--workers 1 or fewer"):
        cluster.wait_for_executors(_FakeSc("spark://m:7077", ["hostA"]), 2, timeout=0.1, poll=0.05)


def test_dynamic_allocation_does_not_wait_for_executors_it_adds_for_waiting_tasks():
    """Executors come only for waiting tasks: waiting for them before any task would always time out."""
    sc = _FakeSc("yarn", [], {"spark.dynamicAllocation.enabled": "true"})
    start = time.monotonic()
    found = cluster.wait_for_executors(sc, 2, timeout=30)
    assert time.monotonic() - start < 1 and found is not None and found.count == 0
    assert not cluster.dynamic_allocation(cluster.conf_of(_FakeSc("local[2]", [], {
        "spark.dynamicAllocation.enabled": "true"})))


def test_dynamic_allocation_that_can_never_give_the_slots_is_one_sentence():
    conf = {"spark.dynamicAllocation.enabled": "true", "spark.dynamicAllocation.maxExecutors": "2",
            "spark.executor.cores": "4", "spark.task.cpus": "2"}
    sc = _FakeSc("yarn", [], conf)
    assert cluster.allocation_ceiling(cluster.conf_of(sc)) == 4
    cluster.wait_for_executors(sc, 4, timeout=30)
    with pytest.raises(NbdistError, match=r"stops at 2 executors of 4 cores \(4 slots\); use --workers 4 or fewer"):
        cluster.wait_for_executors(sc, 5, timeout=30)
    unbounded = _FakeSc("yarn", [], {"spark.dynamicAllocation.enabled": "true"})
    assert cluster.allocation_ceiling(cluster.conf_of(unbounded)) is None


def test_speculation_is_refused_for_ordinary_tasks():
    cluster.refuse_speculation(cluster.conf_of(_FakeSc("yarn", [])))
    with pytest.raises(NbdistError, match="spark.speculation=false"):
        cluster.refuse_speculation(cluster.conf_of(_FakeSc("yarn", [], {"spark.speculation": "true"})))


def test_driver_host_other_than_the_route_to_the_master():
    resolve = {"driver.example": "10.9.9.9", "127.0.0.1": "127.0.0.1"}.__getitem__
    message = cluster.no_executors_message("spark://127.0.0.1:7077", "driver.example", 20, resolve)
    assert "spark.driver.host='driver.example' (10.9.9.9)" in message and "to 127.0.0.1" in message


def test_other_masters_get_both_causes():
    message = cluster.no_executors_message("yarn", "10.9.9.9", 20, lambda h: h)
    assert "spark.executor.cores" in message and "spark.driver.host='10.9.9.9'" in message


def test_coordinator_on_the_route_to_the_executors(monkeypatch):
    """The driver's name resolves to loopback (Debian), yet the executors connect over the network."""
    routes = {"10.77.0.2": "10.77.0.1", "10.77.0.3": "10.77.0.1"}
    monkeypatch.setattr(cluster, "route_source", routes.get)
    sc = _FakeSc("spark://10.77.0.1:7077", ["hostA", "hostB"], {"spark.driver.host": "myhost"})
    found = cluster.registered(sc)
    resolve = {"hostA": "10.77.0.2", "hostB": "10.77.0.3", "myhost": "127.0.1.1"}.__getitem__
    assert cluster.coordinator_host(sc, found, resolve) == "10.77.0.1"
    assert cluster.coordinator_host(_FakeSc("local[2]", []), None, resolve) == "127.0.0.1"
    # no executor host known: what spark.driver.host resolves to, loopback as loopback
    assert cluster.coordinator_host(sc, None, resolve) == "127.0.0.1"


def test_gloo_interface_toward_the_store(monkeypatch):
    # Set, not deleted: the choice below writes os.environ, and only a set variable is put back afterwards (a
    # "lo" left over sent later tests' Gloo on other hosts to loopback). Empty counts as unset.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")
    monkeypatch.setattr(collective, "_auto_choice", None)
    assert collective.choose_gloo_interface("127.0.0.1") == "lo"
    assert collective.interface_of("127.0.0.1") == "lo"
    # the automatic choice is not taken for the user's on the next run in this process
    monkeypatch.setattr(collective, "address_toward", lambda peer: "10.77.0.2")
    monkeypatch.setattr(collective, "interface_of", lambda address: "eth0")
    assert collective.choose_gloo_interface("10.77.0.3") == "eth0"
    # the backend's choice (loopback for local workers) beats the route
    assert collective.choose_gloo_interface("10.77.0.3", "lo") == "lo"


def test_users_gloo_interface_wins(monkeypatch):
    monkeypatch.setattr(collective, "_auto_choice", None)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    assert collective.choose_gloo_interface("127.0.0.1", "lo") == "eth7"


def test_missing_nbdist_on_the_executors_says_how_to_give_them_a_python():
    from nbdist.spark.backend import summarize_spark_error

    message = summarize_spark_error(RuntimeError("Python worker failed\nModuleNotFoundError: No module named 'nbdist'"))
    assert message.startswith("the executors cannot import nbdist") and "os.environ['PYSPARK_PYTHON']" in message
    assert "spark.pyspark.python is ignored" in message


def test_a_pyspark_older_than_3_5_is_refused_in_one_sentence():
    """mapInArrow's barrier stages and job tags came in Spark 3.5: an older PySpark is one sentence, not a
    TypeError from deep inside a launch."""
    for version in ("3.5.0", "3.5.9", "4.0.0.dev1", "4.3.0", "10.0.0"):
        cluster.check_spark_version(version)
    for version in ("3.4.4", "3.3.0", "2.4.8"):
        with pytest.raises(NbdistError, match=rf"Spark 3.5 or later, and this notebook's PySpark is {version}; "):
            cluster.check_spark_version(version)
