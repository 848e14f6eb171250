"""A failure at any stage leaves the notebook's model wholly as it was, and says so (issue 29): in the error's
sentence for nbdist's own failures, in the log where the error is the model's own, raised as itself (issue 46).

Stages: a worker failing before its first epoch ends, one failing mid-run, and the trained state
failing while it is put into the notebook's model (after every worker finished).
"""
from __future__ import annotations

import keras
import numpy as np
import pytest

import nbdist
import nbdist.model.spec as model_io
from nbdist.errors import TrainingFailed

pytestmark = pytest.mark.usefixtures("no_leftover_workers")


def failing_model(after_steps: int):
    """A model whose layer raises inside the training step once it has run ``after_steps`` times."""
    import tensorflow as tf

    class Boom(keras.layers.Layer):
        def build(self, shape):
            self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")

        def call(self, x, training=None):
            if training:
                self.calls.assign_add(1.0)
                tf.debugging.assert_less(self.calls, float(after_steps), message="injected failure in Boom")
            return x

    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((64,)), Boom(), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    return model


def whole_state(model):
    return ([np.asarray(w).copy() for w in model.get_weights()],
            [np.asarray(v.numpy()).copy() for v in model_io.optimizer_state_variables(model)])


def assert_same_state(model, before):
    weights, optimizer = whole_state(model)
    assert all(np.array_equal(a, b) for a, b in zip(weights, before[0]))
    assert len(optimizer) == len(before[1]) and all(np.array_equal(a, b) for a, b in zip(optimizer, before[1]))


@pytest.fixture
def trained_once(digits):
    """A model trained locally once: its optimizer has moments and a step count to lose."""
    def make(after_steps: int):
        x, y = digits
        model = failing_model(after_steps)
        model.layers[0].calls.assign(-1e9)  # the local fit must not trip it
        model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
        model.layers[0].calls.assign(0.0)
        return model, whole_state(model)
    return make


@pytest.mark.parametrize("after_steps,stage", [(2, "before the first epoch ends"), (60, "mid-run")])
def test_a_worker_failing_leaves_the_model_untouched_and_says_so(after_steps, stage, digits, trained_once, caplog):
    """The model's own error is raised as TensorFlow raises it (issue 46); the log says what the model holds."""
    import tensorflow as tf

    x, y = digits
    model, before = trained_once(after_steps)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        nbdist.train(model, x, y, epochs=4, batch_size=32, workers=2, backend="local", strategy="allreduce")
    assert "injected failure in Boom" in str(info.value)
    assert "the notebook's model was left as it was before the run" in caplog.text, stage
    assert_same_state(model, before)


def test_state_failing_on_its_way_into_the_model_is_rolled_back_and_says_so(digits, trained_once, monkeypatch):
    x, y = digits
    model, before = trained_once(10 ** 6)
    real = model_io.set_values
    calls = []

    def half_then_fail(variables, values, what):
        calls.append(what)
        if len(calls) == 1:  # the first write into the notebook's model: half of it, then a failure
            real(variables[: len(variables) // 2], values[: len(values) // 2], what)
            raise RuntimeError("injected failure while writing the state")
        return real(variables, values, what)

    monkeypatch.setattr(model_io, "set_values", half_then_fail)
    with pytest.raises(TrainingFailed) as info:
        nbdist.train(model, x, y, epochs=2, batch_size=32, workers=2, backend="local")
    assert "the model was left as it was before the run" in str(info.value)
    assert "injected failure while writing the state" in str(info.value)
    assert len(calls) == 2  # the half write, then the roll-back
    assert_same_state(model, before)


def test_a_failure_after_callbacks_read_the_model_says_which_epoch_it_holds(digits, trained_once, caplog):
    """Callbacks that read the model get the shared weights each epoch, as with local fit; a later failure
    leaves the model at the last epoch they saw (as a local fit's error does), and the sentence says so."""
    x, y = digits
    model, _ = trained_once(60)  # 29 steps per worker and epoch: the third epoch fails

    class Seen(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.weights = []

        def on_epoch_end(self, epoch, logs=None):
            self.weights.append([w.copy() for w in self.model.get_weights()])

    import tensorflow as tf

    seen = Seen()
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        nbdist.train(model, x, y, epochs=4, batch_size=32, workers=2, backend="local", strategy="allreduce",
                     callbacks=[seen])
    assert "injected failure in Boom" in str(info.value) and "left as it was" not in caplog.text
    assert f"holds the weights of epoch {len(seen.weights)}, the last its callbacks saw" in caplog.text
    assert len(seen.weights) == 2
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), seen.weights[-1]))
