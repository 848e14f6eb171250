"""An elastic run in containers (docs/elastic.md): a worker's container killed (``podman kill``) is survived,
and a container started in its place joins the others at their next commit.

Needs a usable container engine (scripts/install_system_deps.sh); without one the test is skipped with the
engine's own sentence, as tests/containers/test_containers.py's are.
"""
from __future__ import annotations

import subprocess

import pytest

from nbdist.api import prepare
from nbdist.backends.containers import find_engine
from nbdist.config import TrainConfig
from nbdist.errors import NbdistError

from .test_containers import run_containers

EPOCHS = 6  # the kill lands in the second epoch or a little later: the join needs a commit after its regroup


@pytest.mark.full("a killed worker survived and replaced: tests/workers/test_elastic.py's killed-worker test; a "
                  "container's failure named and removed: test_containers.py's raising-worker test")
def test_a_killed_container_is_survived_and_replaced(digits):
    try:
        engine = find_engine()
    except NbdistError as exc:
        pytest.skip(str(exc))
    import keras

    x, y = digits
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "sparse_categorical_crossentropy", metrics=["accuracy"])
    killed: dict = {}

    def kill_after_first_epoch(kind, state, payload):
        if kind == "epoch" and not killed and state.epochs_done >= 1:
            killed["name"] = job._backend.container_name(1)
            killed["kill"] = subprocess.Popen([engine.path, "kill", killed["name"]], stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL)  # the event loop goes on meanwhile

    job = prepare(model, TrainConfig(epochs=EPOCHS, workers="2:3", batch_size=32, shuffle=False, seed=3,
                                     backend="containers", ui="none"), x, y, None,
                  listeners=[kill_after_first_epoch])
    job.start()
    history = job.wait(timeout=400)
    killed["kill"].wait(timeout=60)

    assert job.status == "done" and [len(v) for v in history.values()] == [EPOCHS] * len(history)
    lost, joined = job.state.membership
    assert lost.left == [1] and lost.workers == [0, 2] and "SIGKILL" in lost.why
    assert joined.left == [] and joined.joined == [3] and joined.workers == [0, 2, 3]
    assert joined.committed == lost.committed + 1  # at the survivors' next commit
    assert job._backend.workers[3].name.endswith("-w3")  # the replacement is a container of the run
    assert sorted(job.reports) == [0, 2, 3] and job.state.world_size == 3
    assert run_containers(engine, job._backend.run_id) == []  # the replacement's container is removed too
