"""Issue 39: a cell seeded as Keras' documentation says (``keras.utils.set_random_seed(42)``) reproduces under
``%%dist_train`` without ``--seed``, as it does locally: two runs, identical weights and History (dropout, the
default shuffle). Without a seed two runs differ, as locally, also when everything the cell itself draws is
fixed: the run's own randomness (the shuffle) is fresh. Real TensorFlow workers, digits; the JAX and torch
workers' version is in test_backends.py."""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

MAGIC = "%%dist_train --workers 2 --ui none\n"
FIT = "history = model.fit(X, y, batch_size=64, epochs=2, validation_split=0.25)\n"
SEEDED = ("keras.utils.set_random_seed(42)\n"
          "model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation='relu'),\n"
          "                          keras.layers.Dropout(0.3), keras.layers.Dense(10, activation='softmax')])\n"
          "model.compile('adam', 'sparse_categorical_crossentropy', metrics=['accuracy'])\n" + FIT)
# Everything the cell draws fixed (initial weights, the Dropout's own seed): only the run's randomness is left.
UNSEEDED = ("init = keras.initializers.GlorotUniform(7)\n"
            "model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, 'relu', kernel_initializer=init),\n"
            "                          keras.layers.Dropout(0.3, seed=5), keras.layers.Dense(10, 'softmax')])\n"
            "model.layers[-1].set_weights(fixed_top)\n"
            "model.compile('adam', 'sparse_categorical_crossentropy', metrics=['accuracy'])\n" + FIT)


def _run(ip, cell: str) -> tuple[list[np.ndarray], dict[str, list[float]]]:
    result = ip.run_cell(MAGIC + cell)
    assert result.success, result.error_in_exec
    return ip.user_ns["model"].get_weights(), ip.user_ns["history"].history


def test_a_seeded_cell_reproduces_and_an_unseeded_one_does_not(ip):
    ip.run_cell("import keras, numpy as np\n"
                "fixed_top = [np.full((32, 10), 0.05, 'float32'), np.zeros(10, 'float32')]")
    first_weights, first_history = _run(ip, SEEDED)
    second_weights, second_history = _run(ip, SEEDED)
    assert second_history == first_history  # every entry, bit for bit
    assert all(np.array_equal(a, b) for a, b in zip(first_weights, second_weights))

    one, one_history = _run(ip, UNSEEDED)
    two, two_history = _run(ip, UNSEEDED)
    assert one_history != two_history
    assert max(float(np.abs(a - b).max()) for a, b in zip(one, two)) > 1e-4
