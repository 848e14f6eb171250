"""Training a model that was already trained continues it, optimizer step count included (issue 16)."""
from __future__ import annotations

import keras
import numpy as np
import pytest

import nbdist

from ..conftest import mlp, relative_error
from .test_training import interleave_batches

pytestmark = pytest.mark.usefixtures("no_leftover_workers")


def steps(model) -> int:
    return int(model.optimizer.iterations.numpy())


def test_local_then_nbdist_equals_local_for_all_epochs(digits):
    """Adam: 2 local epochs then 2 nbdist epochs (1 worker) == 4 local epochs: the bias correction
    continues from step 114, where a restarted count would take much larger first steps."""
    x, y = digits
    x, y = x[:900], y[:900]
    ref, model = mlp(seed=7), mlp(seed=7)
    model.set_weights(ref.get_weights())
    ref.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    nbdist.train(model, x, y, epochs=2, batch_size=32, workers=1, shuffle=False)
    assert steps(model) == steps(ref) == 4 * 29
    assert relative_error(model.get_weights(), ref.get_weights()) < 1e-6
    assert relative_error([v.numpy() for v in model.optimizer.variables[2:]],
                          [v.numpy() for v in ref.optimizer.variables[2:]]) < 1e-6


def test_two_runs_equal_one_run_of_twice_the_epochs_with_a_schedule(digits):
    """C2 conditions with a fast-decaying learning-rate schedule: the second run's schedule goes on
    from step 57, so two 1-epoch runs equal one 2-epoch run and the big-batch local fit."""
    x, y = digits
    x, y = x[:900], y[:900]

    def sgd():
        return keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.2, 10, 0.5))

    local, twice, once = mlp(seed=8, optimizer=sgd()), mlp(seed=8, optimizer=sgd()), mlp(seed=8, optimizer=sgd())
    twice.set_weights(local.get_weights())
    once.set_weights(local.get_weights())
    options = {"batch_size": 16, "workers": 2, "strategy": "averaging", "averaging_frequency": 1, "shuffle": False}
    nbdist.train(twice, x, y, epochs=1, **options)
    nbdist.train(twice, x, y, epochs=1, **options)
    nbdist.train(once, x, y, epochs=2, **options)
    idx = interleave_batches(np.arange(len(x)), 2, 16)
    local.fit(x[idx], y[idx], batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert steps(twice) == steps(once) == steps(local) == 2 * 29
    assert relative_error(twice.get_weights(), once.get_weights()) < 1e-6
    assert relative_error(twice.get_weights(), local.get_weights()) < 1e-5


def test_empty_cell_with_model_name_continues_training(ip):
    ip.run_cell("import keras\nfrom tests.conftest import mlp\ncont = mlp(seed=9)")
    result = ip.run_cell("%%dist_train --model cont --data X,y --epochs 1 --workers 1 --ui none\n")
    assert result.success, result.error_in_exec
    first = steps(ip.user_ns["cont"])
    result = ip.run_cell("%%dist_train --model cont --data X,y --epochs 1 --workers 1 --ui none\n")
    assert result.success
    assert steps(ip.user_ns["cont"]) == 2 * first == 2 * 19


def test_an_object_that_cannot_travel_is_named_before_any_worker(ip, capsys, tmp_path):
    """A layer holding an open file: one sentence names it, the kernel lives, the model is untouched."""
    ip.user_ns["log_path"] = str(tmp_path / "log.txt")
    ip.run_cell(
        "import keras\n"
        "class Logger(keras.layers.Layer):\n"
        "    def __init__(self, stream):\n"
        "        super().__init__()\n"
        "        self.stream = stream\n"
        "    def call(self, x):\n"
        "        return x\n"
        "logged = keras.Sequential([keras.Input((64,)), Logger(open(log_path, 'w')),\n"
        "                           keras.layers.Dense(10, activation='softmax')])\n"
        "logged.compile('adam', 'sparse_categorical_crossentropy')\n"
        "before = [w.copy() for w in logged.get_weights()]")
    capsys.readouterr()
    result = ip.run_cell("%%dist_train --model logged --data X,y --epochs 1 --workers 2 --ui none\npass")
    assert not result.success
    err = capsys.readouterr().err
    assert "layer Logger, attribute stream (TextIOWrapper) cannot be sent to the workers" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    ns = ip.user_ns
    assert all(np.array_equal(a, b) for a, b in zip(ns["logged"].get_weights(), ns["before"]))
    assert steps(ns["logged"]) == 0
    assert ip.run_cell("1 + 1").result == 2
