"""A model's own attributes travel with it, whatever their names; TensorFlow's bookkeeping does not."""
from __future__ import annotations

import keras
import numpy as np

from nbdist.model.spec import model_from_spec, travelling_model


class SelfAttentionBlock(keras.layers.Layer):
    """Named as keras_hub's TransformerEncoder names its sublayers: ``_self_attention_layer`` and so on."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._self_attention_layer = keras.layers.Dense(8, kernel_initializer=keras.initializers.GlorotUniform(1))
        self._self_scale = 0.5

    def call(self, x):
        return self._self_attention_layer(x) * self._self_scale


def test_attributes_named_self_underscore_travel():
    """They were taken for TensorFlow's checkpoint bookkeeping (``_self_update_uid`` and the like) and dropped:
    the worker's copy had no ``_self_attention_layer`` and its first step raised AttributeError."""
    model = keras.Sequential([keras.Input((4,)), SelfAttentionBlock(), keras.layers.Dense(2)])
    model.compile("adam", "mse")
    copy = model_from_spec(travelling_model(model))
    block = copy.layers[0]
    assert isinstance(block._self_attention_layer, keras.layers.Dense) and block._self_scale == 0.5
    x = np.random.default_rng(0).random((3, 4), dtype=np.float32)
    np.testing.assert_allclose(copy.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    copy.fit(x, np.zeros((3, 2), "float32"), verbose=0)  # and it trains
