"""What ``compile`` was given travels as Keras was given it: on TensorFlow's backend a list, tuple or dict
assigned to a model (``model.loss``) is held in TensorFlow's tracking wrappers, which Keras' ``tree`` takes
for other node types or leaves; the workers' copy and the door's label check see the plain structure."""
from __future__ import annotations

import keras
import numpy as np

from nbdist.model.graph import untracked
from nbdist.model.labels import loss_refusal
from nbdist.model.spec import model_from_spec, travelling_model


def _model() -> keras.Model:
    inputs = keras.Input((4,))
    heads = [keras.layers.Dense(1)(inputs) for _ in range(3)]
    model = keras.Model(inputs, (heads[0], [heads[1], heads[2]]))
    model.compile("sgd", loss=("mse", ["mae", "mse"]))
    return model


def test_a_tuple_of_losses_holding_a_list_travels_plain_and_passes_the_label_check():
    model = _model()
    assert type(model.loss[1]) is not list  # TensorFlow's ListWrapper: what the test is about
    plain = untracked(model.loss)
    assert type(plain) is tuple and type(plain[1]) is list and plain == ("mse", ["mae", "mse"])
    copy = model_from_spec(travelling_model(model))
    assert type(copy.loss) is tuple and type(copy.loss[1]) is list
    target = np.zeros((4, 1), "float32")
    assert loss_refusal(model, (target, [target, target])) is None
    assert untracked({"a": (1, [2])}) == {"a": (1, [2])}  # nothing wrapped: as it is
