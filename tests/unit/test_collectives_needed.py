"""Local workers without torch meet on the host (machine/placement.meeting); an engine named on the magic line
that needs torch, in a Python without it, is told so in one sentence before any worker starts
(placement.collectives_missing, checked by TrainingJob.start on local workers)."""
from __future__ import annotations

import numpy as np
import pytest

from nbdist.errors import NbdistError
from nbdist.machine.placement import collectives_missing, meeting


def without(*names: str):
    return lambda name: name not in names


def test_an_engine_that_needs_torch_without_torch_is_told_what_to_install():
    for strategy, engine in (("allreduce", "gloo"), ("allreduce", "nccl"), ("allreduce", "jax")):
        sentence = collectives_missing(2, strategy, engine, has_module=without("torch"))
        assert sentence is not None and "pip install 'nbdist[torch]'" in sentence and "\n" not in sentence
    assert "--engine nccl" in collectives_missing(4, "allreduce", "nccl", has_module=without("torch"))


def test_without_torch_local_workers_meet_on_the_host():
    assert meeting("local", 2, "allreduce", has_torch=False) == "host"
    assert meeting("local", 2, "averaging", has_torch=False) == "host"
    assert meeting("local", 2, "allreduce", has_torch=True) == "torch"
    assert meeting("spark", 2, "allreduce", has_torch=False) == "torch"
    assert meeting("local", 1, "allreduce", has_torch=False) == "torch"
    assert collectives_missing(2, "allreduce", None, has_module=without("torch")) is None
    assert collectives_missing(2, "averaging", None, has_module=without("torch")) is None


def test_one_worker_async_or_torch_present_need_nothing_more():
    assert collectives_missing(1, "allreduce", None, has_module=without("torch")) is None
    assert collectives_missing(3, "async", None, has_module=without("torch")) is None
    assert collectives_missing(2, "allreduce", None, has_module=without()) is None


def test_the_run_refuses_before_any_worker_starts(monkeypatch):
    import importlib.util

    import keras

    from nbdist.driver.training import TrainingJob

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    launched = []
    monkeypatch.setattr(TrainingJob, "_launch", lambda self, backend: launched.append(backend))
    import nbdist

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    x, y = np.zeros((8, 4), "float32"), np.zeros(8, "int32")
    with pytest.raises(NbdistError, match=r"pip install 'nbdist\[torch\]'"):
        nbdist.train(model, x, y, workers=2, backend="local", engine="gloo")
    assert launched == []
