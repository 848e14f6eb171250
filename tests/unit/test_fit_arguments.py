"""A model.fit(...) call's arguments as the typed FitCall: Keras' own names and defaults, what was spelled out."""
from __future__ import annotations

import dataclasses
import inspect

import keras
import numpy as np
import pytest

from nbdist.driver.fit_call import bind_fit
from nbdist.errors import NbdistError
from nbdist.fit_arguments import FitCall


def test_fit_call_has_keras_fit_arguments_and_defaults():
    keras_fit = {name: p.default for name, p in inspect.signature(keras.Model.fit).parameters.items()
                 if name != "self"}
    ours = {f.name: f.default for f in dataclasses.fields(FitCall) if f.name != "given"}
    assert ours == keras_fit


def test_a_bound_call_names_what_was_spelled_out_and_is_frozen():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    x = np.zeros((8, 4))
    fit = bind_fit(model, (x,), {"epochs": 3, "validation_split": 0.25}, inspect.signature(keras.Model.fit))
    assert isinstance(fit, FitCall) and fit.x is x and fit.epochs == 3 and fit.batch_size is None
    assert fit.given == {"x", "epochs", "validation_split"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        fit.epochs = 4  # type: ignore[misc]
    assert fit.replace(epochs=4).epochs == 4 and fit.epochs == 3
    with pytest.raises(NbdistError, match="call it as you would without the magic"):
        bind_fit(model, (x,), {"epoch": 3}, inspect.signature(keras.Model.fit))
