"""Across machines for real: a Spark standalone cluster on two simulated hosts (network namespaces).

Each host has its own loopback, hostname, /etc/hosts (its name on 127.0.1.1) and /dev/shm, and
a second interface that leads nowhere (netns_cluster.py). One cluster serves the whole module;
the variants that need another SparkSession come last.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from ..spark_helpers import accuracy, digits, digits_frame, need_spark, small_model, spark_session
from .netns_cluster import BRIDGE_IP, HOSTS, UNREACHABLE_IP, NetnsCluster, why_not_possible

need_spark()
_why = why_not_possible()
if _why:
    pytest.skip(_why, allow_module_level=True)

import nbdist  # noqa: E402
from nbdist.errors import NbdistError, TrainingFailed  # noqa: E402

pytestmark = [pytest.mark.multihost, pytest.mark.timeout(600)]  # a cold cluster takes ~1 min to start

EPOCHS = 8
WORKER = "nbdist.worker"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # No warm workers left on the hosts (tests/spark/conftest.py): "nothing left" means nothing.
    c = NetnsCluster(tmp_path_factory.mktemp("netns")).start()
    try:
        yield c
    finally:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None:
            active.stop()
        c.close()


def _session(cluster: NetnsCluster, driver: str = BRIDGE_IP, **conf: str):
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    if active is not None:
        active.stop()
    return spark_session(cluster.master_url, **{"spark.driver.host": driver, "spark.driver.bindAddress": driver,
                                                "spark.executor.memory": "1g", **conf})


@pytest.fixture(scope="module")
def spark(cluster):
    return _session(cluster)


@pytest.fixture(scope="module")
def data():
    return digits()


@pytest.fixture(scope="module")
def local_accuracy(data):
    """The same runs on local worker processes: the reference each strategy must match, run once when a
    test first asks for that strategy's (CI's make test leaves out the averaging case)."""
    X_tr, X_te, y_tr, y_te = data
    found: dict[str, float] = {}

    def of(strategy: str) -> float:
        if strategy not in found:
            model = small_model()
            nbdist.train(model, X_tr, y_tr, epochs=EPOCHS, batch_size=32, workers=2, strategy=strategy,
                         backend="local", seed=0, ui="none")
            found[strategy] = accuracy(model, X_te, y_te)
        return found[strategy]

    return of


def _train(data, strategy: str, **kw):
    X_tr, X_te, y_tr, y_te = data
    model = small_model()
    job = nbdist.train(model, X_tr, y_tr, epochs=EPOCHS, batch_size=32, workers=2, strategy=strategy,
                       backend="spark", seed=0, ui="none", **kw)
    return job, accuracy(model, X_te, y_te)


def _left_on_hosts(cluster: NetnsCluster) -> dict[str, list[int]]:
    return {h.name: cluster.pids_on(h, WORKER) for h in HOSTS if cluster.pids_on(h, WORKER)}


@pytest.mark.parametrize("strategy", [pytest.param("averaging", marks=pytest.mark.full), "allreduce"])
def test_trains_across_two_hosts(cluster, spark, data, local_accuracy, strategy):
    job, acc = _train(data, strategy)
    assert sorted(w.host for w in job.state.workers) == ["hostA", "hostB"]  # one task on each machine
    assert abs(acc - local_accuracy(strategy)) <= 0.01, (acc, local_accuracy(strategy))
    if strategy == "allreduce":  # two machines never sum through shared memory
        summed = [r["summed_by"] for r in job.reports.values()]
        assert len(summed) == 2 and "shared" not in summed, summed
    assert not _left_on_hosts(cluster)


def test_names_resolving_to_a_second_interface(cluster, spark, data, local_accuracy):
    """Each host's name resolves to eth1, a network the other host is not on: Gloo must not bind it."""
    try:
        for h in HOSTS:
            cluster.set_name_address(h, h.ip2)
        job, acc = _train(data, "allreduce")
    finally:
        for h in HOSTS:
            cluster.set_name_address(h, "127.0.1.1")
    assert sorted(w.host for w in job.state.workers) == ["hostA", "hostB"]
    assert abs(acc - local_accuracy("allreduce")) <= 0.01


def _wait_training_on(cluster, host, job) -> None:
    """Until ``job`` has merged an epoch and has a worker on ``host`` (training, across both hosts)."""
    deadline = time.monotonic() + 180
    while not (job.history.get("loss") and cluster.pids_on(host, WORKER)):
        assert job.status not in ("failed", "done"), job.error
        assert time.monotonic() < deadline, "training did not start within 180 s"
        time.sleep(0.2)


def test_killed_worker_on_one_host(cluster, spark, data):
    X_tr, _, y_tr, _ = data
    job = nbdist.train(small_model(), X_tr, y_tr, epochs=400, batch_size=32, workers=2, strategy="allreduce",
                       backend="spark", seed=0, ui="none", background=True)
    host = HOSTS[1]
    _wait_training_on(cluster, host, job)
    victim = cluster.pids_on(host, WORKER)[0]
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(TrainingFailed) as err:
        job.wait(timeout=60)
    took = time.monotonic() - killed
    assert took < 10, f"failed {took:.1f} s after the kill"
    assert host.name in str(err.value) and str(victim) in str(err.value), str(err.value)
    deadline = time.monotonic() + 20
    while _left_on_hosts(cluster):
        assert time.monotonic() < deadline, f"left behind: {_left_on_hosts(cluster)}"
        time.sleep(0.5)


@pytest.mark.full("a killed worker replaced on Spark: test_spark_elastic.py's killed-worker test; elastic across the "
                  "two hosts: test_elastic_run_goes_on_without_a_host_cut_off")
def test_elastic_run_loses_and_regains_a_hosts_worker(cluster, spark, data):
    """An elastic run (1:3) across the two hosts, one task slot each: the third worker's job waits for a slot.
    hostB's worker is SIGKILLed after the first epoch; hostA's worker rolls back to its commit and trains on,
    the waiting job takes hostB's freed slot and its worker joins at hostA's next commit (the driver is held at
    the regroup until it connected, so that it is that commit), and the run finishes on both hosts."""
    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    X_tr, _, y_tr, _ = data
    run: dict = {}

    def until_worker_2_connects(kind, state, payload):
        if kind == "membership" and payload.left and payload.generation > 0:
            deadline = time.monotonic() + 120
            while 2 not in run["job"]._coordinator.connected() and time.monotonic() < deadline:
                time.sleep(0.2)

    job = run["job"] = prepare(small_model(), TrainConfig(epochs=30, workers="1:3", batch_size=32, seed=0,
                                                          strategy="allreduce", backend="spark", ui="none"),
                               X_tr, y_tr, None, listeners=[until_worker_2_connects])
    job.start().run_in_background()
    host = HOSTS[1]
    _wait_training_on(cluster, host, job)
    (gone,) = [w.rank for w in job.state.workers if w.host == host.name]
    os.kill(cluster.pids_on(host, WORKER)[0], signal.SIGKILL)
    history = job.wait(timeout=300)
    assert job.status == "done" and len(history["loss"]) == 30
    first, left, joined = job.state.membership
    assert first.left == [2] and "no free Spark task slot" in first.why, first.line
    assert left.left == [gone] and left.workers == [1 - gone] and "SIGKILL" in left.why, left.line
    assert (joined.left, joined.joined, joined.workers) == ([], [2], [1 - gone, 2]), joined.line
    assert joined.committed == left.committed + 1  # the survivor's next commit: the next epoch's start
    assert [job.state.workers[r].host for r in (1 - gone, 2)] == [HOSTS[0].name, host.name]
    assert sorted(job.reports) == [1 - gone, 2] and job.state.world_size == 2
    deadline = time.monotonic() + 20
    while _left_on_hosts(cluster):
        assert time.monotonic() < deadline, f"left behind: {_left_on_hosts(cluster)}"
        time.sleep(0.5)


def test_elastic_run_goes_on_without_a_host_cut_off(cluster, spark, data):
    """An elastic run (1:2) with a worker on each host; hostB is cut off after the first epoch: its worker lives
    and holds its connections, silent. Past heartbeat_timeout the driver takes it for lost and cancels its job,
    hostA's worker leaves the Gloo sum it waits in on the driver's word, rolls back and finishes the run alone.
    Once hostB is back, nothing of the run is left on it."""
    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    X_tr, _, y_tr, _ = data
    job = prepare(small_model(), TrainConfig(epochs=30, workers="1:2", batch_size=32, seed=0, strategy="allreduce",
                                             backend="spark", ui="none", heartbeat_interval=1, heartbeat_timeout=8),
                  X_tr, y_tr, None)
    job.start().run_in_background()
    host = HOSTS[1]
    _wait_training_on(cluster, host, job)
    (gone,) = [w.rank for w in job.state.workers if w.host == host.name]
    with cluster.cut_off(host):
        cut = time.monotonic()
        while not job.state.membership and time.monotonic() - cut < 60:
            time.sleep(0.1)
        took = time.monotonic() - cut
        history = job.wait(timeout=300)
    assert job.status == "done" and len(history["loss"]) == 30
    (left,) = [c for c in job.state.membership if c.left]
    assert left.left == [gone] and left.workers == [1 - gone] and left.why.startswith("sent nothing for "), left.line
    assert 8 <= took < 30, took  # the silence, then the survivor's word: not the collective's 300 s
    assert job.state.workers[1 - gone].host == HOSTS[0].name and job.state.world_size == 1
    deadline = time.monotonic() + 60
    while _left_on_hosts(cluster):
        assert time.monotonic() < deadline, f"left behind: {_left_on_hosts(cluster)}"
        time.sleep(0.5)


def test_coordinator_unreachable_from_the_hosts(cluster, spark, data, monkeypatch):
    """A coordinator address the executors cannot reach: one sentence naming the worker, the address and the setting."""
    from nbdist.spark import cluster as spark_cluster

    monkeypatch.setattr(spark_cluster, "coordinator_host", lambda sc, executors: "127.0.0.1")
    start = time.monotonic()
    with pytest.raises(TrainingFailed) as err:
        _train(data, "averaging")
    took = time.monotonic() - start
    message = str(err.value).splitlines()[0]
    assert took < 30, took
    assert message.startswith("worker ") and "cannot reach the notebook at 127.0.0.1:" in message, message
    assert "advertise_host" in message, message
    assert not _left_on_hosts(cluster)


def test_no_executors(cluster, data):
    """Executors wider than any worker: none starts; one sentence before counting rows, not a hang."""
    spark = _session(cluster, **{"spark.executor.cores": "2"})  # each host offers one core
    df = digits_frame(spark, data[0], data[2])
    start = time.monotonic()
    with pytest.raises(NbdistError) as err:
        nbdist.train(small_model(), df, features=["pixels"], label="digit", epochs=1, batch_size=32, workers=2,
                     backend="spark", ui="none", executor_wait=3)  # none can come: 20 s proves nothing more
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert message.startswith("no Spark executor registered") and "spark.executor.cores" in message, message


def test_driver_address_unreachable(cluster, data):
    """spark.driver.host on an address the hosts have no route to: executors never register."""
    spark = _session(cluster, driver=UNREACHABLE_IP)
    df = digits_frame(spark, data[0], data[2])
    start = time.monotonic()
    with pytest.raises(NbdistError) as err:
        nbdist.train(small_model(), df, features=["pixels"], label="digit", epochs=1, batch_size=32, workers=2,
                     backend="spark", ui="none", executor_wait=3)  # none can come: 20 s proves nothing more
    assert time.monotonic() - start < 30
    message = str(err.value)
    assert f"spark.driver.host='{UNREACHABLE_IP}'" in message and f"to {BRIDGE_IP}" in message, message
