"""Deep Keras models travel whole: pickling recurses ~20 levels per layer, past Python's default limit."""
from __future__ import annotations

import sys

import keras
import numpy as np

from nbdist.model.spec import model_from_spec, travelling_model


def test_a_keras_application_deeper_than_pythons_recursion_limit_travels_whole():
    """MobileNetV2's 156 layers take ~2,000 levels of pickling recursion (DenseNet121: 8,000), past Python's
    1,000: the spec is made in a thread with room for them, and the model it brings back predicts alike."""
    keras.utils.set_random_seed(3)
    model = keras.applications.MobileNetV2(input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=10)
    model.compile("adam", "sparse_categorical_crossentropy")
    limit = sys.getrecursionlimit()
    spec = travelling_model(model)
    assert sys.getrecursionlimit() == limit  # raised only while the model was pickled
    copy = model_from_spec(spec)
    x = np.random.default_rng(0).random((4, 32, 32, 3), dtype=np.float32)
    assert len(copy.layers) == len(model.layers)
    np.testing.assert_allclose(copy.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6, atol=1e-7)
