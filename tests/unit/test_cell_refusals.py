"""Issue 30: a hand-written training loop and a stateful RNN are refused in one sentence before
anything runs (the loop is recognised by reading the cell's code, never by running it)."""
from __future__ import annotations

import keras
import numpy as np
import pytest
from IPython.core.error import UsageError

import nbdist
from nbdist.checks import custom_training_loop
from nbdist.errors import NbdistError

from ..conftest import ipython_shell, worker_processes

# keras.io's "Writing a training loop from scratch", shortened: a tf.function step and an epoch loop.
SCRATCH_LOOP = """
import keras, tensorflow as tf
ran_before_refusal = True
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
optimizer = keras.optimizers.Adam(1e-3)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    optimizer.apply(tape.gradient(loss, model.trainable_weights), model.trainable_weights)
    return loss

for epoch in range(8):
    train_step(X, y)
"""

# keras.io's "Customizing what happens in fit()": the documented way, which nbdist distributes.
TRAIN_STEP_CELL = """
import keras, tensorflow as tf
class MyModel(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(y=y, y_pred=self(x, training=True))
        self.optimizer.apply_gradients(zip(tape.gradient(loss, self.trainable_variables), self.trainable_variables))
        return {"loss": loss}
"""


@pytest.mark.parametrize("source, mark", [
    (SCRATCH_LOOP, "tf.GradientTape"),
    ("for xb, yb in batches:\n    model.train_on_batch(xb, yb)\n", "model.train_on_batch"),
    ("opt.apply_gradients(zip(g, v))\n", "optimizer.apply_gradients"),
    (TRAIN_STEP_CELL, None),  # a subclassed model's own train_step: fit runs it
    (TRAIN_STEP_CELL + "model = MyModel()\nmodel.fit(X, y)\n", None),
    (SCRATCH_LOOP + "model.fit(X, y)\n", None),  # the cell's fit is what trains
    ("model = make()\nmodel.compile('adam', 'mse')\n", None),
    ("this is not python (\n", None),
])
def test_custom_loop_is_read_from_the_code(source, mark):
    assert custom_training_loop(source) == mark


def test_a_scratch_loop_cell_is_refused_before_it_runs():
    """The keras.io loop under %%dist_train: one sentence naming train_step and fit; none of the cell ran."""
    ip = ipython_shell()
    ip.user_ns.pop("ran_before_refusal", None)
    ip.user_ns.update(X=np.zeros((8, 64), "float32"), y=np.zeros(8, "int64"))
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("dist_train", "--workers 2 --ui none", SCRATCH_LOOP)
    message = str(info.value)
    assert "tf.GradientTape" in message and "train_step" in message and "model.fit(...)" in message
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence
    assert "ran_before_refusal" not in ip.user_ns
    assert not worker_processes()


def test_a_stateful_rnn_is_refused_before_any_worker_starts():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input(batch_shape=(32, 5, 3)), keras.layers.GRU(4, stateful=True),
                              keras.layers.Dense(1)])
    model.compile("adam", "mse")
    before = [w.copy() for w in model.get_weights()]
    x, y = np.zeros((64, 5, 3), "float32"), np.zeros((64, 1), "float32")
    for call in (lambda: nbdist.train(model, x, y, epochs=1, batch_size=16, workers=2, shuffle=False),
                 lambda: nbdist.train(model, x, y, sample_weight=np.ones(64, "float32"), epochs=1, batch_size=16,
                                      workers=2, shuffle=False)):  # the fit-style path too
        with pytest.raises(NbdistError) as info:
            call()
        assert "stateful" in str(info.value) and "batch size of 32" in str(info.value)
        assert not worker_processes()
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))


UNALIKE_EPOCHS = """
import keras
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
model.compile("sgd", "sparse_categorical_crossentropy")
hist = model.fit(X, y, batch_size=64, epochs=3, steps_per_epoch=4, verbose=0)
"""


def test_steps_per_epoch_keras_would_run_unalike_is_refused_before_any_worker_starts():
    """384 rows, 6 batches, 4 steps per epoch: Keras runs epochs of 4, 2, 4 steps; one sentence saying so."""
    ip = ipython_shell()
    ip.user_ns.pop("hist", None)
    ip.user_ns.update(X=np.zeros((384, 64), "float32"), y=np.zeros(384, "int64"))
    with pytest.raises(UsageError) as info:
        ip.run_cell_magic("dist_train", "--workers 2 --ui none", UNALIKE_EPOCHS)
    message = str(info.value)
    assert "steps_per_epoch=4" in message and "4, 2, 4" in message and message.count(". ") == 0
    assert "hist" not in ip.user_ns and not worker_processes()
