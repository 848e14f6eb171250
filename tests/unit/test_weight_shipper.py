"""Rank 0's weight shipper: the state it keeps is the epoch's, whatever trains or averages after it."""
from __future__ import annotations

import keras
import numpy as np

from nbdist.strategies.averaging import variable_views
from nbdist.worker.callbacks import WeightShipper


def _model() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(keras.optimizers.Adam(), "mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _shipper(model: keras.Model, epochs: int) -> tuple[WeightShipper, list]:
    sent: list = []
    ship = WeightShipper(lambda msg: sent.append((msg.epoch, [np.array(a) for a in msg.weights + msg.optimizer])),
                         model, every_epoch=False, epochs=epochs)
    return ship, sent


def test_the_kept_state_is_a_copy_that_an_in_place_round_does_not_reach():
    """An averaging round writes into the variables' own memory (averaging.variable_views): a kept view of
    it would change with the next round, and a stop would send the middle of an epoch."""
    model = _model()
    ship, sent = _shipper(model, epochs=5)
    at_epoch_end = [np.array(w) for w in model.get_weights()]
    ship(0)
    views = variable_views(model.weights)
    assert views is not None
    for view, _ in views:
        view += 1.0  # the next round, in place
    del views
    ship.on_stop()
    assert [epoch for epoch, _ in sent] == [0]
    kernel_and_bias = sent[0][1][:len(at_epoch_end)]
    assert all(np.array_equal(a, b) for a, b in zip(kernel_and_bias, at_epoch_end))


def test_after_the_last_epoch_the_state_is_read_when_sent_and_sent_once():
    model = _model()
    ship, sent = _shipper(model, epochs=2)
    ship(0)
    ship(1)  # the last: nothing trains after it, so no copy is made
    assert ship._last is not None and ship._last[1] is None
    ship.finish()
    ship.on_stop()  # a stop after the end sends nothing more
    assert [epoch for epoch, _ in sent] == [1]
    assert all(np.array_equal(a, b) for a, b in zip(sent[0][1], model.get_weights()))
    assert ship.sent == 1
