"""Keras' optimizer updates as TensorFlow's fused kernels (strategies/fused_updates.py), in-process.

The fused step must be Keras' step: the same weights and slots after several updates, with what
Keras does around the update (clipping, weight decay, schedules, the step count) left to Keras.
"""
from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")

from nbdist.strategies.fused_updates import fused_kind, install_fused_updates  # noqa: E402

OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam-clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.5),
    "adam-global-clipnorm": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.3),
    "adamw-schedule": lambda: keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(0.02, 3, 0.5),
                                                     weight_decay=0.05, beta_1=0.8),
    "sgd": lambda: keras.optimizers.SGD(0.1, clipvalue=0.2),
    "sgd-momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd-nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
}


def _train(make_optimizer, fused: bool) -> list[np.ndarray]:
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(5)])
    model.compile(make_optimizer(), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.optimizer.build(model.trainable_variables)
    if fused:
        assert install_fused_updates(model)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)).astype("float32"), rng.integers(0, 5, 64)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return [v.numpy() for v in model.weights + model.optimizer.variables]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_fused_update_is_keras_update(name):
    kind = fused_kind(OPTIMIZERS[name]())
    assert kind == name.split("-")[0].replace("adamw", "adam")
    ours, keras_own = _train(OPTIMIZERS[name], True), _train(OPTIMIZERS[name], False)
    # The equivalence suite's tolerance (tests/workers/test_same_step.py): the kernels may fuse a
    # multiply and an add, so the last bit differs and 8 steps carry it through the model.
    for a, b in zip(ours, keras_own):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_what_has_no_fused_kernel_keeps_keras_update():
    class OwnAdam(keras.optimizers.Adam):
        def update_step(self, gradient, variable, learning_rate):
            return super().update_step(gradient, variable, learning_rate)

    assert fused_kind(keras.optimizers.Adam(amsgrad=True)) is None
    assert fused_kind(keras.optimizers.RMSprop()) is None
    assert fused_kind(OwnAdam()) is None
    assert fused_kind(keras.optimizers.AdamW()) == "adam"


def test_by_default_only_a_large_model_gets_fused_updates():
    from nbdist.strategies.fused_updates import FUSED_MIN_PARAMETERS

    small = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    small.compile("adam", "mse")
    assert install_fused_updates(small, FUSED_MIN_PARAMETERS) == []
    assert type(small.optimizer).update_step is keras.optimizers.Adam.update_step  # nothing replaced
    large = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024)])
    large.compile("adam", "mse")
    assert install_fused_updates(large, FUSED_MIN_PARAMETERS) == ["adam"]


def test_an_embedding_table_does_not_make_a_model_large_enough_to_fuse():
    """A table's sparse rows keep Keras' update, so they do not count toward FUSED_MIN_PARAMETERS: a
    model of 1.3M parameters, all but 33 of them in a table, keeps Keras' own update for its Dense layer,
    bit for bit (fused, the last-bit differences grew under Adam on the table's rows: issue 39)."""
    from nbdist.strategies.fused_updates import FUSED_MIN_PARAMETERS

    def train(fused: bool) -> list[np.ndarray]:
        keras.utils.set_random_seed(4)
        ids = keras.Input((3,), dtype="int32")
        vectors = keras.layers.Flatten()(keras.layers.Embedding(40_000, 32)(ids))
        model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Dense(1)(vectors)))
        model.compile(keras.optimizers.Adam(0.01), "mse")
        if fused:
            assert install_fused_updates(model, FUSED_MIN_PARAMETERS) == ["adam"]
        rng = np.random.default_rng(1)
        model.fit(rng.integers(0, 40_000, (256, 3)), rng.normal(size=(256, 1)), batch_size=32, epochs=2,
                  shuffle=False, verbose=0)
        return model.get_weights()

    for a, b in zip(train(fused=True), train(fused=False)):
        np.testing.assert_array_equal(a, b)


def test_a_large_dense_model_still_gets_the_fused_kernel_when_traced():
    from nbdist.strategies.fused_updates import FUSED_MIN_PARAMETERS

    large = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(1024)])
    large.compile("adam", "mse")
    assert install_fused_updates(large, FUSED_MIN_PARAMETERS) == ["adam"]
    large.fit(np.ones((4, 1024), "float32"), np.ones((4, 1024), "float32"), verbose=0)
    assert large.optimizer._nbdist_fuse is True  # its 1M parameters have dense gradients
