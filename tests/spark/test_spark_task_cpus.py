"""A Spark worker's thread budget on a cluster is its task's CPUs (spark.task.cpus), not the notebook's share.

A standalone worker offering 6 cores runs two executors of 3 cores with spark.task.cpus=3: each of 2 workers
gets 3 threads, where this 2-core notebook's share would be 1.
"""
from __future__ import annotations

import pytest

from ..spark_helpers import digits, need_spark, small_model, spark_session, standalone_cluster

need_spark()

from nbdist.api import prepare  # noqa: E402
from nbdist.config import TrainConfig  # noqa: E402


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    with standalone_cluster(tmp_path_factory, cores=6) as master:
        session = spark_session(master, **{"spark.executor.cores": "3", "spark.task.cpus": "3",
                                           "spark.executor.memory": "768m", "spark.cores.max": "6"})
        yield session
        session.stop()


def test_each_worker_gets_its_tasks_cpus(spark):
    Xtr, _, ytr, _ = digits()
    seen: dict[int, str] = {}

    def environ(kind, state, payload):  # what each worker process was started with, read while it runs
        for w in job._backend.workers if kind == "epoch" else ():
            with open(f"/proc/{w.pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            seen[w.rank] = env[b"OMP_NUM_THREADS"].decode()

    job = prepare(small_model(), TrainConfig(epochs=2, workers=2, backend="spark", ui="none"), Xtr, ytr, None,
                  listeners=[environ])
    job.start()
    job.wait(timeout=300)
    assert job.status == "done" and job._threads() != 3  # this machine's share: not what the tasks have
    assert [w.threads for w in job._backend.workers] == [3, 3]  # as the tasks said
    assert seen == {0: "3", 1: "3"}
    assert [job._worker_threads(r) for r in range(2)] == [3, 3]  # what the job messages carried
