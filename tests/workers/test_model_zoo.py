"""The whole model reaches the workers and comes back (issue 29): one model per kind of state.

Each zoo entry builds the same model twice from a seed. The reference is the local ``fit`` on the
global batch (``shuffle=False``); the distributed run is ``nbdist.train`` on 2 real worker processes
under allreduce, whose global batches hold the same rows. Deterministic models must end with the
same weights, optimizer state and History to 1e-5 (the policy's precision under float16); models
that draw random numbers (dropout, noise, a GAN's latent samples) within a point of accuracy.
Everything here is defined inside functions, as a notebook's classes would be: they travel by value.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest

import nbdist
from nbdist.model.graph import optimizers_of

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

WORKERS, BATCH, EPOCHS, ROWS = 2, 16, 2, 256


@dataclasses.dataclass
class Case:
    build: Callable[[np.ndarray, np.ndarray], tuple[Any, Any, Any]]  # (x, y) -> (compiled model, x, y)
    exact: bool = True  # the same numbers on 2 workers: compared to 1e-5; else by accuracy
    random: bool = False  # draws random numbers: even 1 worker is compared by accuracy
    rtol: float = 1e-5
    labels: bool = True  # fit(x, y); False: fit(x) (a GAN)
    local_input: Callable[[Any], Any] | None = None  # what the local fit takes instead (Keras refuses numpy str)


def _head(*layers: Any, inputs: Any = None, dtype: str | None = None) -> Any:
    return keras.Sequential([inputs if inputs is not None else keras.Input((64,), dtype=dtype), *layers,
                             keras.layers.Dense(10, activation="softmax", dtype="float32")])


def _compile(model: Any, optimizer: Any = "adam", **kwargs: Any) -> Any:
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"], **kwargs)
    return model


def normalization(x, y):
    norm = keras.layers.Normalization()
    norm.adapt(x * 10)  # the layer's mean and variance exist only as derived state
    return _compile(_head(norm, keras.layers.Dense(16, activation="relu"))), x * 10, y


def integer_lookup(x, y):
    ids = (x[:, :8] * 16).astype("int64") * 7  # int ids through an adapted vocabulary (a lookup table)
    lookup = keras.layers.IntegerLookup()
    lookup.adapt(ids)
    model = keras.Sequential([keras.Input((8,), dtype="int64"), lookup,
                              keras.layers.Embedding(lookup.vocabulary_size(), 4), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    return _compile(model, keras.optimizers.SGD(0.1)), ids, y


def string_lookup(x, y):
    words = np.array([f"w{int(v)}" for v in (x[:, 20] * 16)])  # a numpy str array, a vocabulary asset
    lookup = keras.layers.StringLookup()
    lookup.adapt(words)
    model = keras.Sequential([keras.Input((1,), dtype="string"), lookup,
                              keras.layers.Embedding(lookup.vocabulary_size(), 4), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    return _compile(model, keras.optimizers.SGD(0.1)), words.reshape(-1, 1), y


def given_vocabulary(x, y):
    words = np.array([f"w{int(v)}" for v in (x[:, 20] * 16)])
    # A vocabulary given to the constructor: Keras keeps it in the config, not in the layer's assets.
    lookup = keras.layers.StringLookup(vocabulary=sorted(set(words.tolist()))[::2])  # half are out of it
    model = keras.Sequential([keras.Input((1,), dtype="string"), lookup,
                              keras.layers.Embedding(lookup.vocabulary_size(), 4), keras.layers.Flatten(),
                              keras.layers.Dense(10, activation="softmax")])
    return _compile(model, keras.optimizers.SGD(0.1)), words.reshape(-1, 1), y


def text_vectorization(x, y):
    text = [" ".join(f"t{int(v)}" for v in row[18:30:3] * 16) for row in x]  # a list of str
    vectorize = keras.layers.TextVectorization(max_tokens=40, output_sequence_length=4)
    vectorize.adapt(text)
    model = keras.Sequential([keras.Input((), dtype="string"), vectorize, keras.layers.Embedding(40, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10, activation="softmax")])
    return _compile(model, keras.optimizers.SGD(0.1)), text, y


def discretization(x, y):
    bins = keras.layers.Discretization(num_bins=4, output_mode="one_hot")
    bins.adapt(x[:, :8])
    model = keras.Sequential([keras.Input((8,)), bins, keras.layers.Flatten(), keras.layers.Dense(10, "softmax")])
    return _compile(model), x[:, :8], y


def category_and_hashing(x, y):
    ids = (x[:, :4] * 16).astype("int64")
    inp = keras.Input((4,), dtype="int64")
    hashed = keras.layers.Hashing(num_bins=32, salt=7)(inp)
    onehot = keras.layers.CategoryEncoding(num_tokens=32, output_mode="multi_hot")(hashed)
    return _compile(keras.Model(inp, keras.layers.Dense(10, "softmax")(onehot))), ids, y


def counter_layer(x, y):
    class StepCount(keras.layers.Layer):  # a non-trainable integer variable it updates itself
        def build(self, shape):
            self.steps = self.add_weight(shape=(), dtype="int64", initializer="zeros", trainable=False)

        def call(self, inputs, training=None):
            if training:
                self.steps.assign_add(1)
            return inputs

    return _compile(_head(StepCount(), keras.layers.Dense(16, activation="relu"))), x, y


def mixed(policy: str):
    """A model made under a mixed policy (under mixed_float16 a LossScaleOptimizer wraps Adam)."""
    def build(x, y):
        keras.mixed_precision.set_global_policy(policy)
        try:
            model = _compile(_head(keras.layers.Dense(32, activation="relu")))
        finally:
            keras.mixed_precision.set_global_policy("float32")
        return model, x, y
    return build


def loss_scale_optimizer(x, y):
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05, momentum=0.9), initial_scale=2.0 ** 8)
    return _compile(_head(keras.layers.Dense(32, activation="relu")), opt), x, y


def adamw_excluded(x, y):
    opt = keras.optimizers.AdamW(1e-2, weight_decay=0.5)
    opt.exclude_from_weight_decay(var_names=["bias"])  # recorded by no config
    return _compile(_head(keras.layers.Dense(32, activation="relu")), opt), x, y


def schedule_momentum(x, y):
    lr = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=3, decay_rate=0.5)
    return _compile(_head(keras.layers.Dense(32, activation="relu")), keras.optimizers.SGD(lr, momentum=0.9)), x, y


def rmsprop_clipnorm(x, y):
    opt = keras.optimizers.RMSprop(1e-3, clipnorm=0.5, centered=True)
    return _compile(_head(keras.layers.Dense(32, activation="relu")), opt), x, y


def continued(x, y):
    model = _compile(_head(keras.layers.Dense(32, activation="relu")))
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0, shuffle=False)  # Adam's moments and step
    return model, x, y


def frozen_layer(x, y):
    frozen = keras.layers.Dense(32, activation="relu")
    model = _compile(_head(frozen))
    frozen.trainable = False  # set after compile, as notebooks do: recompile then
    return _compile(model), x, y


def float64_layers(x, y):
    return _compile(_head(keras.layers.Dense(16, activation="relu", dtype="float64"))), x.astype("float64"), y


def regularized(x, y):
    dense = keras.layers.Dense(32, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-2),
                               kernel_constraint=keras.constraints.MaxNorm(1.0))
    return _compile(_head(dense, keras.layers.ActivityRegularization(l1=1e-3))), x, y


def lstm(x, y):
    model = keras.Sequential([keras.Input((8, 8)), keras.layers.LSTM(8), keras.layers.Dense(10, "softmax")])
    return _compile(model), x.reshape(-1, 8, 8), y


def attention(x, y):
    inp = keras.Input((8, 8))
    h = keras.layers.MultiHeadAttention(2, 4)(inp, inp)
    h = keras.layers.LayerNormalization()(keras.layers.Flatten()(h))
    # SGD: the key bias's gradient is zero up to rounding, and Adam would turn that noise into lr-sized steps.
    return _compile(keras.Model(inp, keras.layers.Dense(10, "softmax")(h)), keras.optimizers.SGD(0.1)), \
        x.reshape(-1, 8, 8), y


def two_inputs_lambda(x, y):
    scale = 0.5  # a closure over a notebook variable
    a, b = keras.Input((32,), name="a"), keras.Input((32,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Lambda(lambda t: t * scale)(a), keras.layers.Dense(8)(b)])
    model = _compile(keras.Model({"a": a, "b": b}, keras.layers.Dense(10, "softmax")(h)))
    return model, {"a": x[:, :32], "b": x[:, 32:]}, y


def stateful_metric(x, y):
    class Hits(keras.metrics.Metric):  # a notebook metric with its own state variables
        def __init__(self, name="hits", **kwargs):
            super().__init__(name=name, **kwargs)
            self.hits = self.add_variable(shape=(), initializer="zeros", name="h")
            self.seen = self.add_variable(shape=(), initializer="zeros", name="n")

        def update_state(self, y_true, y_pred, sample_weight=None):
            right = keras.ops.cast(keras.ops.equal(keras.ops.argmax(y_pred, -1),
                                                   keras.ops.cast(keras.ops.reshape(y_true, (-1,)), "int64")),
                                   "float32")
            self.hits.assign_add(keras.ops.sum(right))
            self.seen.assign_add(keras.ops.cast(keras.ops.shape(right)[0], "float32"))

        def result(self):
            return self.hits / keras.ops.maximum(self.seen, 1.0)

    model = _head(keras.layers.Dense(16, activation="relu"))
    model.compile("adam", "sparse_categorical_crossentropy", metrics=[Hits()])
    return model, x, y


def own_compile_two_optimizers(x, y):
    class TwoParts(keras.Model):
        """Overrides compile with two optimizers its train_step applies: no config records them."""

        def __init__(self):
            super().__init__()
            self.body = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu")])
            self.top = keras.Sequential([keras.Input((16,)), keras.layers.Dense(10, activation="softmax")])
            self.loss_tracker = keras.metrics.Mean(name="loss")

        def compile(self, body_optimizer, top_optimizer, loss_fn):
            super().compile()
            self.body_optimizer, self.top_optimizer, self.loss_fn = body_optimizer, top_optimizer, loss_fn

        def call(self, inputs):
            return self.top(self.body(inputs))

        @property
        def metrics(self):
            return [self.loss_tracker]

        def train_step(self, data):
            import tensorflow as tf

            xb, yb = data
            with tf.GradientTape() as tape:
                loss = self.loss_fn(yb, self(xb, training=True))
            body, top = self.body.trainable_weights, self.top.trainable_weights
            grads = tape.gradient(loss, body + top)
            self.body_optimizer.apply_gradients(zip(grads[:len(body)], body))
            self.top_optimizer.apply_gradients(zip(grads[len(body):], top))
            self.loss_tracker.update_state(loss)
            return {"loss": self.loss_tracker.result()}

    model = TwoParts()
    model.compile(keras.optimizers.Adam(1e-2), keras.optimizers.SGD(0.1, momentum=0.5),
                  keras.losses.SparseCategoricalCrossentropy())
    return model, x, y


def gan(x, y):
    class GAN(keras.Model):
        """keras.io's GAN shape: an outer model that is not built, two built parts, two optimizers."""

        def __init__(self, discriminator, generator, latent):
            super().__init__()
            self.discriminator, self.generator, self.latent = discriminator, generator, latent
            self.d_loss = keras.metrics.Mean(name="d_loss")
            self.seed = keras.random.SeedGenerator(3)

        def compile(self, d_optimizer, g_optimizer, loss_fn):
            super().compile()
            self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

        @property
        def metrics(self):
            return [self.d_loss]

        def train_step(self, real):
            import tensorflow as tf

            n = tf.shape(real)[0]
            fake = self.generator(keras.random.normal((n, self.latent), seed=self.seed))
            with tf.GradientTape() as tape:
                p = self.discriminator(tf.concat([fake, real], 0))
                loss = self.loss_fn(tf.concat([tf.ones((n, 1)), tf.zeros((n, 1))], 0), p)
            d_vars = self.discriminator.trainable_weights
            self.d_optimizer.apply_gradients(zip(tape.gradient(loss, d_vars), d_vars))
            with tf.GradientTape() as tape:
                fooled = self.discriminator(self.generator(keras.random.normal((n, self.latent), seed=self.seed)))
                g_loss = self.loss_fn(tf.zeros((n, 1)), fooled)
            g_vars = self.generator.trainable_weights
            self.g_optimizer.apply_gradients(zip(tape.gradient(g_loss, g_vars), g_vars))
            self.d_loss.update_state(loss)
            return {"d_loss": self.d_loss.result()}

    d = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1, "sigmoid")])
    g = keras.Sequential([keras.Input((4,)), keras.layers.Dense(64, activation="sigmoid")])
    model = GAN(d, g, 4)
    model.compile(keras.optimizers.Adam(1e-3), keras.optimizers.Adam(1e-3), keras.losses.BinaryCrossentropy())
    return model, x, None


def dropout_noise(x, y):
    return _compile(_head(keras.layers.GaussianNoise(0.05), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dropout(0.2))), x, y


def batch_norm(x, y):
    return _compile(_head(keras.layers.Dense(32), keras.layers.BatchNormalization(),
                          keras.layers.Activation("relu"))), x, y


ZOO = {
    "normalization": Case(normalization),
    "integer_lookup": Case(integer_lookup),
    "string_lookup": Case(string_lookup, local_input=lambda x: __import__("tensorflow").constant(x)),
    "text_vectorization": Case(text_vectorization, local_input=lambda x: __import__("tensorflow").constant(x)),
    "given_vocabulary": Case(given_vocabulary, local_input=lambda x: __import__("tensorflow").constant(x)),
    "discretization": Case(discretization),
    "category_and_hashing": Case(category_and_hashing),
    "counter_layer": Case(counter_layer),
    "mixed_float16": Case(mixed("mixed_float16"), rtol=2e-3),
    "mixed_bfloat16": Case(mixed("mixed_bfloat16"), rtol=2e-2),
    "loss_scale_optimizer": Case(loss_scale_optimizer),
    "adamw_excluded": Case(adamw_excluded),
    "schedule_momentum": Case(schedule_momentum),
    "rmsprop_clipnorm": Case(rmsprop_clipnorm),
    "continued": Case(continued),
    "frozen_layer": Case(frozen_layer),
    "float64_layers": Case(float64_layers),
    "regularized": Case(regularized),
    "lstm": Case(lstm),
    "attention": Case(attention),
    "two_inputs_lambda": Case(two_inputs_lambda),
    "stateful_metric": Case(stateful_metric),
    "dropout_noise": Case(dropout_noise, exact=False, random=True),
    "batch_norm": Case(batch_norm, exact=False),
}
# Models whose own train_step applies optimizers of their own train under averaging (allreduce refuses them).
OWN_OPTIMIZERS = {"own_compile_two_optimizers": Case(own_compile_two_optimizers),
                  "gan": Case(gan, exact=False, labels=False)}


@pytest.fixture(scope="module")
def data(digits):
    x, y = digits
    return x[:ROWS], y[:ROWS]


def _built(case: Case, data: tuple[np.ndarray, np.ndarray], seed: int = 5) -> tuple[Any, Any, Any]:
    keras.utils.set_random_seed(seed)
    return case.build(*data)


def _local(case: Case, data, epochs: int = EPOCHS) -> tuple[Any, dict[str, list[float]]]:
    model, x, y = _built(case, data)
    x = case.local_input(x) if case.local_input else x
    history = model.fit(x, y, batch_size=WORKERS * BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model, history.history


def _states(model: Any, local: Any) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Both models' weights and the state of every optimizer the local fit built (a model whose own
    train_step never applies model.optimizer leaves it unbuilt locally; nbdist builds it, empty)."""
    def values(variables: list[Any]) -> list[np.ndarray]:
        return [np.asarray(v.numpy(), dtype="float64") for v in variables]

    got, want = values(model.weights), values(local.weights)
    for mine, theirs in zip(optimizers_of(model), optimizers_of(local), strict=True):
        if theirs.built:
            got += values([v for v in mine.variables if "learning_rate" not in v.path])
            want += values([v for v in theirs.variables if "learning_rate" not in v.path])
    return got, want


def _assert_close(got: list[np.ndarray], want: list[np.ndarray], rtol: float) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, (i, a.shape, b.shape)
        # A floor for tensors near zero (an attention key bias, whose gradient is rounding noise).
        assert np.linalg.norm(a - b) <= rtol * max(np.linalg.norm(b), 1e-3), (i, float(np.abs(a - b).max()))


def _accuracy(model: Any, x: Any, y: np.ndarray) -> float:
    return float((np.argmax(model.predict(x, verbose=0), axis=-1) == y).mean())


# Cases whose path another case covers in CI (make test-full runs them): the case that covers each.
FURTHER = {"string_lookup": "text_vectorization", "discretization": "normalization",
           "category_and_hashing": "integer_lookup", "mixed_bfloat16": "mixed_float16",
           "loss_scale_optimizer": "mixed_float16", "schedule_momentum": "rmsprop_clipnorm",
           "lstm": "regularized", "attention": "regularized", "two_inputs_lambda": "regularized"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.full(f"the {FURTHER[name]} case"))
                                  if name in FURTHER else name for name in sorted(ZOO)])
def test_two_workers_under_allreduce_train_the_whole_model_as_the_local_global_batch(name, data, digits):
    case = ZOO[name]
    # Inexact models train long enough on all of digits for a point of accuracy to mean something.
    data, epochs = (data, EPOCHS) if case.exact else (digits, 5)
    local, local_history = _local(case, data, epochs)
    model, x, y = _built(case, data)
    job = nbdist.train(model, x, y, epochs=epochs, batch_size=BATCH, workers=WORKERS, strategy="allreduce",
                       shuffle=False, callbacks=[], backend="local", lr_scaling="none")
    assert job.status == "done"
    if case.exact:
        _assert_close(*_states(model, local), case.rtol)
        for key, values in local_history.items():
            np.testing.assert_allclose(job.history[key], values, rtol=max(case.rtol, 1e-5), err_msg=key)
    else:
        assert abs(_accuracy(model, x, y) - _accuracy(local, x, y)) <= 0.01 + 1e-9
        got, want = _states(model, local)
        assert [a.shape for a in got] == [b.shape for b in want]
    # The notebook's model holds what the workers trained: its whole state, its step count included.
    assert int(model.optimizer.iterations.numpy()) == int(local.optimizer.iterations.numpy())
    # And it evaluates and predicts as the workers' evaluation and prediction of it say.
    if name in ("normalization", "integer_lookup", "given_vocabulary", "mixed_float16", "batch_norm"):
        merged = nbdist.evaluate(model, x, y, workers=1, backend="local")
        here_x = case.local_input(x) if case.local_input else x
        here = model.evaluate(here_x, y, verbose=0, return_dict=True)
        assert merged["accuracy"] == pytest.approx(here["accuracy"], abs=1e-6)
        assert merged["loss"] == pytest.approx(here["loss"], rel=1e-4)
        predicted = nbdist.predict(model, x, workers=1, backend="local")
        np.testing.assert_allclose(predicted, model.predict(here_x, verbose=0), atol=2e-3 if "mixed" in name else 1e-6)


@pytest.mark.full  # the two-worker test below covers the same travel and more; this one tells travel from sync
@pytest.mark.parametrize("name", sorted(ZOO) + ["own_compile_two_optimizers"])
def test_one_worker_equals_the_local_fit(name, data, digits):
    """One worker trains the model it received as the notebook's own fit would (BatchNorm included)."""
    case = {**ZOO, **OWN_OPTIMIZERS}[name]
    data, epochs = (digits, 5) if case.random else (data, EPOCHS)
    model_l, x, y = _built(case, data)
    history = model_l.fit(case.local_input(x) if case.local_input else x, y, batch_size=BATCH, epochs=epochs,
                          shuffle=False, verbose=0).history
    model, x, y = _built(case, data)
    job = nbdist.train(model, x, y, epochs=epochs, batch_size=BATCH,
                       strategy="averaging", workers=1, shuffle=False, callbacks=[],
                       backend="local")
    if case.random:
        assert abs(_accuracy(model, x, y) - _accuracy(model_l, x, y)) <= 0.01 + 1e-9
        return
    _assert_close(*_states(model, model_l), case.rtol)
    for key, values in history.items():
        np.testing.assert_allclose(job.history[key], values, rtol=max(case.rtol, 1e-5), err_msg=key)


@pytest.mark.parametrize("name", sorted(OWN_OPTIMIZERS))
def test_a_model_with_its_own_optimizers_trains_with_each_of_them(name, data):
    """Averaging every step: each worker applies both optimizers to its half; their state comes back."""
    case = OWN_OPTIMIZERS[name]
    model, x, y = _built(case, data)
    before = [np.asarray(w).copy() for w in model.get_weights()]
    nbdist.train(model, x, y, epochs=EPOCHS, batch_size=BATCH, workers=WORKERS,
                 strategy="averaging", averaging_frequency=1,
                 shuffle=False, callbacks=[], backend="local", lr_scaling="none")
    assert any(not np.allclose(a, b) for a, b in zip(model.get_weights(), before))
    steps = EPOCHS * (ROWS // (WORKERS * BATCH))
    own = [o for o in (getattr(model, n, None) for n in ("body_optimizer", "top_optimizer", "d_optimizer",
                                                         "g_optimizer")) if o is not None]
    assert len(own) == 2 and all(int(o.iterations.numpy()) == steps for o in own)
    assert all(o.built and len(o.variables) > 2 for o in own)  # built on the workers, slots came back


def test_allreduce_refuses_a_model_with_its_own_optimizers_before_any_worker_starts(data):
    model, x, y = _built(OWN_OPTIMIZERS["own_compile_two_optimizers"], data)
    with pytest.raises(nbdist.NbdistError, match="--strategy averaging"):
        nbdist.train(model, x, y, epochs=1, batch_size=BATCH, workers=2, strategy="allreduce", backend="local")

