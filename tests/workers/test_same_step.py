"""The same step (issue 30): 2 workers equal the local ``fit`` on the global batch, for every kind of
gradient and loss normalisation Keras produces. Real worker processes, real TensorFlow.

One functional model holds every case, so each optimizer costs one launch of workers:
- ``reg``: a dense branch (Dense gradients);
- ``cls``: an Embedding without a mask (a sparse ``tf.IndexedSlices`` gradient that Keras applies
  with scatter updates: Adam's and RMSprop's squares of its duplicate rows differ from the dense sum's);
- ``seq``: an Embedding with ``mask_zero`` and a loss per timestep (normalised by the valid steps of
  the global batch, not of each worker's share);
- ``mk``: a ``Masking`` layer over float sequences, a loss per timestep, masked the same way;
- ``tw``: a loss per timestep weighted by per-timestep (temporal) sample weights;
all with ``loss_weights``. 300 rows and a global batch of 64: the last batch is short (44 rows).
The workers' halves of every batch are equal: Keras records each output's ``<name>_loss`` as an
unweighted mean over batches (its batch size is unknown when traced), so with unequal halves (an odd
global batch, or a last batch of fewer rows than workers) those entries alone differ from local fit's;
the weights and ``loss`` stay equal (measured with 257 rows, pad steps included: weights 6e-8 (allreduce,
Adam) and 2e-7 (averaging, SGD) apart, ``loss`` 1e-7).
"""
from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest

import nbdist

from ..conftest import mlp, relative_error

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

ROWS, SEQ, VOCAB, GLOBAL_BATCH, EPOCHS = 300, 10, 40, 64, 2


def case_data(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (ROWS, SEQ)).astype("int32")
    lengths = rng.integers(2, SEQ + 1, ROWS)
    masked_ids = np.where(np.arange(SEQ)[None, :] < lengths[:, None], ids, 0).astype("int32")  # padded ends
    floats = rng.normal(size=(ROWS, SEQ, 3)).astype("float32")
    floats[np.arange(SEQ)[None, :] >= rng.integers(1, SEQ + 1, ROWS)[:, None]] = 0.0  # Masking's padding
    x = {"x": rng.normal(size=(ROWS, 6)).astype("float32"), "ids": ids, "mids": masked_ids, "fl": floats,
         "tf": rng.normal(size=(ROWS, SEQ, 2)).astype("float32")}
    y = {"reg": rng.normal(size=(ROWS, 1)).astype("float32"),
         "cls": (ids[:, 0] % 2).astype("int32"),
         "seq": (masked_ids % 3).astype("int32"),
         "mk": rng.normal(size=(ROWS, SEQ, 1)).astype("float32"),
         "tw": rng.normal(size=(ROWS, SEQ, 1)).astype("float32")}
    # Keras needs a masked output's weights per timestep too (a row's weight would not broadcast over its mask).
    weights = {"reg": np.ones(ROWS, "float32"), "cls": np.ones(ROWS, "float32"),
               "seq": np.ones((ROWS, SEQ), "float32"), "mk": np.ones((ROWS, SEQ), "float32"),
               "tw": rng.uniform(0.0, 3.0, (ROWS, SEQ)).astype("float32")}  # one weight per timestep
    return x, y, weights


def case_model(optimizer: Any, jit_compile: Any = "auto") -> Any:
    keras.utils.set_random_seed(7)
    x = keras.Input((6,), name="x")
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    mids = keras.Input((SEQ,), dtype="int32", name="mids")
    fl = keras.Input((SEQ, 3), name="fl")
    tf_in = keras.Input((SEQ, 2), name="tf")
    reg = keras.layers.Dense(1, name="reg")(keras.layers.Dense(8, activation="tanh")(x))
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(VOCAB, 8)(ids))
    cls = keras.layers.Dense(2, activation="softmax", name="cls")(pooled)
    seq = keras.layers.Dense(3, activation="softmax", name="seq")(
        keras.layers.Embedding(VOCAB, 6, mask_zero=True)(mids))
    mk = keras.layers.Dense(1, name="mk")(keras.layers.Dense(4, activation="tanh")(keras.layers.Masking(0.0)(fl)))
    tw = keras.layers.Dense(1, name="tw")(tf_in)
    model = keras.Model({"x": x, "ids": ids, "mids": mids, "fl": fl, "tf": tf_in},
                        {"reg": reg, "cls": cls, "seq": seq, "mk": mk, "tw": tw})
    model.compile(optimizer, loss={"reg": "mse", "cls": "sparse_categorical_crossentropy",
                                   "seq": "sparse_categorical_crossentropy", "mk": "mse", "tw": "mse"},
                  loss_weights={"reg": 0.5, "cls": 1.0, "seq": 2.0, "mk": 1.0, "tw": 0.7}, jit_compile=jit_compile)
    return model


def local_and_remote(optimizer: Any, jit_compile: Any = "auto", **options: Any
                     ) -> tuple[Any, Any, dict[str, list[float]], Any]:
    """The same model fit locally on the global batch and by 2 workers (each half of every global batch)."""
    x, y, w = case_data()
    local = case_model(keras.optimizers.deserialize(keras.optimizers.serialize(optimizer)), jit_compile)
    remote = case_model(keras.optimizers.deserialize(keras.optimizers.serialize(optimizer)), jit_compile)
    remote.set_weights(local.get_weights())
    expected = local.fit(x, y, sample_weight=w, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False,
                         verbose=0).history
    job = nbdist.train(remote, x, y, sample_weight=w, epochs=EPOCHS, batch_size=GLOBAL_BATCH // 2, workers=2,
                       shuffle=False, lr_scaling="none", **options)
    return local, remote, expected, job


def assert_same(local: Any, remote: Any, expected: dict[str, list[float]], job: Any) -> None:
    got = job.fit_history.history
    assert set(expected) <= set(got), (sorted(expected), sorted(got))
    for key, values in expected.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5, atol=1e-7, err_msg=key)
    for a, b in zip(remote.get_weights(), local.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [
    keras.optimizers.Adam(0.01),
    pytest.param(keras.optimizers.RMSprop(0.01), marks=pytest.mark.full(
        "a second moment slot under allreduce: the adam case")),
    keras.optimizers.SGD(0.05, momentum=0.9),
    pytest.param(keras.optimizers.AdamW(0.01, weight_decay=0.01), marks=pytest.mark.full(
        "AdamW under allreduce: test_model_zoo.py's adamw_excluded")),
], ids=["adam", "rmsprop", "sgd-momentum", "adamw"])
def test_allreduce_equals_the_local_step(optimizer):
    """Allreduce: weights and every History entry of local fit to 1e-5, for each optimizer."""
    assert_same(*local_and_remote(optimizer, strategy="allreduce"))


def test_averaging_every_step_with_sgd_equals_the_local_step():
    """Averaging with K=1 and plain SGD: the same, for every kind of gradient and loss, compiled with
    jit_compile=True (the default on a GPU): the workers' steps hold the masked losses' count sums, which XLA
    cannot compile, so they run without it (it failed)."""
    assert_same(*local_and_remote(keras.optimizers.SGD(0.1), jit_compile=True, strategy="averaging",
                                  averaging_frequency=1))


# -- the same fit ------------------------------------------------------------------------------
class LastEpochWeights(keras.callbacks.Callback):
    """The raw weights at the last epoch's end, before fit swaps the moving averages in."""

    def on_epoch_end(self, epoch, logs=None):
        self.weights = [w.copy() for w in self.model.get_weights()]


@pytest.mark.parametrize("strategy, optimizer", [
    # Both at once (one launch): the EMA is updated at each applied update, every 3 batches.
    ("allreduce", keras.optimizers.Adam(0.01, use_ema=True, ema_momentum=0.9, gradient_accumulation_steps=3)),
    ("averaging", keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.9)),  # K=1: the EMA slots averaged too
], ids=["allreduce-adam-accumulating", "averaging-sgd"])
def test_ema_and_gradient_accumulation_as_locally(digits, strategy, optimizer):
    """use_ema: Keras swaps the EMA weights into the model at the end of fit, so the notebook's model ends
    with the local fit's (to 1e-5), not the raw last-step weights (which differ from them by far more).
    gradient_accumulation_steps=3: every worker applies the update at the same batch, as locally, and the
    model counts the same batches (Keras' iterations is then computed from them: the run used to end in
    an AttributeError)."""
    x, y = digits[0][:320], digits[1][:320]
    config = keras.optimizers.serialize(optimizer)
    local = mlp(seed=3, optimizer=keras.optimizers.deserialize(config))
    remote = mlp(seed=3, optimizer=keras.optimizers.deserialize(config))
    remote.set_weights(local.get_weights())
    raw = LastEpochWeights()
    expected = local.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[raw]).history
    job = nbdist.train(remote, x, y, epochs=2, batch_size=32, workers=2, shuffle=False, lr_scaling="none",
                       strategy=strategy, averaging_frequency=1, sample_weight=np.ones(len(x), "float32"))
    assert_same(local, remote, expected, job)
    assert relative_error(raw.weights, local.get_weights()) > 1e-2  # the EMA is not the last step's weights
    assert int(remote.optimizer._iterations) == int(local.optimizer._iterations) == 10  # 5 batches x 2 epochs
    if optimizer.gradient_accumulation_steps:
        assert int(remote.optimizer.iterations) == 3  # updates applied


def test_ema_under_a_loss_scale_optimizer_in_an_eager_one_weight_model_ends_as_locally(digits):
    """Issue 46, one launch for two cases: LossScaleOptimizer(Adam(use_ema=True)) (what mixed_float16
    compiles), with a callback that reads the model, ends on the EMA weights as the local fit does (the
    wrapper says use_ema=False: the raw weights came back, 0.07 away); run_eagerly=True with exactly one
    trainable weight trains (an eager one-output numpy_function returned a bare tensor: a reshape error)."""
    x, y = digits[0][:256], digits[1][:256]

    def model():
        made = keras.Sequential([keras.Input((64,)), keras.layers.Dense(
            10, activation="softmax", use_bias=False, kernel_initializer=keras.initializers.GlorotUniform(3))])
        made.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.01, use_ema=True)),
                     "sparse_categorical_crossentropy", run_eagerly=True)
        return made

    local, remote = model(), model()
    raw = LastEpochWeights()
    expected = local.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[raw]).history
    job = nbdist.train(remote, x, y, epochs=2, batch_size=32, workers=2, shuffle=False, lr_scaling="none",
                       callbacks=[LastEpochWeights()])
    assert len(remote.trainable_weights) == 1
    assert_same(local, remote, expected, job)
    assert relative_error(raw.weights, local.get_weights()) > 1e-2  # the EMA is not the last step's weights


def test_terminate_on_nan_returns_the_history_as_keras_does(digits):
    """TerminateOnNaN: a diverging fit stops at the epoch local fit stops, with no error; the History
    keeps the non-finite loss and equals local fit's before it."""
    x, y = digits[0][:256], (digits[1][:256] * 100.0).astype("float32")

    def linear():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.5), "mse")
        return model

    local, remote = linear(), linear()
    expected = local.fit(x, y, batch_size=64, epochs=6, shuffle=False, verbose=0,
                         callbacks=[keras.callbacks.TerminateOnNaN()]).history
    assert len(expected["loss"]) < 6 and not np.isfinite(expected["loss"][-1])  # it diverges, and stops
    job = nbdist.train(remote, x, y, epochs=6, batch_size=32, workers=2, shuffle=False, lr_scaling="none",
                       strategy="allreduce", callbacks=[keras.callbacks.TerminateOnNaN()])
    assert job.status == "done"
    got = job.fit_history.history["loss"]
    assert len(got) == len(expected["loss"]) and not np.isfinite(got[-1])
    np.testing.assert_allclose(got[:-1], expected["loss"][:-1], rtol=1e-5)
    # The model holds the workers' weights at the end of that epoch (Keras stops at its first bad batch,
    # the workers at the epoch's end: the weights there differ), not the ones from before the run.
    assert relative_error(remote.get_weights(), linear().get_weights()) > 1.0


FREQ_CELL = """
import keras
keras.utils.set_random_seed(6)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
hist = model.fit(X[:320], y[:320], batch_size=64, epochs=4, shuffle=False, verbose=0, validation_data=(Xv, yv),
                 validation_freq=2)
"""


def test_validation_freq_validates_the_epochs_keras_validates(ip):
    """fit(validation_freq=2) in a cell: validation after epochs 2 and 4 only; the History equals the
    same cell run locally (val_ entries only for those epochs)."""
    ip.run_cell_magic("dist_train", "--workers 2 --ui none --strategy allreduce", FREQ_CELL)
    got = ip.user_ns["hist"].history
    ip.run_cell(FREQ_CELL).raise_error()
    expected = ip.user_ns["hist"].history
    assert set(got) == set(expected) and len(expected["val_loss"]) == 2 and len(expected["loss"]) == 4
    for key, values in expected.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)


STEPS_CELL = """
import keras
keras.utils.set_random_seed(8)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(OPTIMIZER, "sparse_categorical_crossentropy", metrics=["accuracy"])
hist = model.fit(X[:384], y[:384], batch_size=64, epochs=4, steps_per_epoch=2, shuffle=False, verbose=0,
                 validation_data=(Xv, yv), validation_steps=2)
"""


@pytest.mark.parametrize("line, optimizer", [
    ("--strategy allreduce", "keras.optimizers.Adam(0.01)"),
    ("--strategy averaging --averaging-frequency 1", "keras.optimizers.SGD(0.1)"),
], ids=["allreduce-adam", "averaging-sgd"])
def test_steps_per_epoch_continues_the_data_as_keras_does(ip, line, optimizer):
    """fit(x, y, steps_per_epoch=2, validation_steps=2) on arrays of 6 batches: each epoch reads the next
    2 batches (the 4th starts the data over), each validation the first 2 batches of the validation data,
    as local Keras does; History (every entry) and weights equal the same cell run locally, to 1e-5."""
    cell = STEPS_CELL.replace("OPTIMIZER", optimizer)
    ip.run_cell_magic("dist_train", f"--workers 2 --ui none {line}", cell)
    got, weights = ip.user_ns["hist"].history, ip.user_ns["model"].get_weights()
    steps = int(ip.user_ns["model"].optimizer.iterations)
    ip.run_cell(cell).raise_error()
    expected = ip.user_ns["hist"].history
    assert set(got) == set(expected) and len(expected["loss"]) == 4
    for key, values in expected.items():
        np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)
    for a, b in zip(weights, ip.user_ns["model"].get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert steps == int(ip.user_ns["model"].optimizer.iterations) == 8  # 2 steps x 4 epochs


GENERATOR_CELL = """
import keras
def repeating(batch):
    i = 0
    while True:
        start = (i * batch) % 512
        yield X[start:start + batch], y[start:start + batch]
        i += 1
def once(batch):  # 512 rows: the last batch short
    for start in range(0, 512, batch):
        part = slice(start, min(start + batch, 512))
        yield X[part], y[part], np.linspace(0.5, 1.5, 512)[part]
def mlp(seed):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model
model, model_once = mlp(3), mlp(4)
stream = repeating(64)
hist = model.fit(stream, steps_per_epoch=5, epochs=3, verbose=0)
after = next(stream)[1][:4]
hist_once = model_once.fit(once(60), verbose=0)
"""


def test_a_generator_trains_on_the_batches_keras_draws_from_it(ip):
    """model.fit(generator, steps_per_epoch=5, epochs=3): each epoch the next 5 of its batches, each a global
    batch split over the workers; the notebook's generator is left after the batches the fit used. A finite
    generator (x, y, sample_weight) without steps_per_epoch, its last batch short: one epoch to its end. History and
    weights equal the same cell run locally, to 1e-5 (both were refused)."""
    ip.user_ns["np"] = np
    ip.run_cell_magic("dist_train", "--workers 2 --ui none --strategy allreduce", GENERATOR_CELL)
    runs = [(ip.user_ns[h].history, ip.user_ns[m].get_weights(), int(ip.user_ns[m].optimizer.iterations))
            for h, m in (("hist", "model"), ("hist_once", "model_once"))]
    after = ip.user_ns["after"].copy()
    ip.run_cell(GENERATOR_CELL).raise_error()
    for (got, weights, _), (h, m) in zip(runs, (("hist", "model"), ("hist_once", "model_once"))):
        expected = ip.user_ns[h].history
        assert set(got) == set(expected) and len(got["loss"]) == len(expected["loss"]), (got, expected)
        for key, values in expected.items():
            np.testing.assert_allclose(got[key], values, rtol=1e-5, err_msg=key)
        for a, b in zip(weights, ip.user_ns[m].get_weights()):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # 5 steps x 3 epochs; 9 batches of 60 (the last 32), once. (Keras on TensorFlow counts a 10th iteration at
    # a generator's end, with the weights unchanged: compared above.)
    assert runs[0][2] == int(ip.user_ns["model"].optimizer.iterations) == 15 and runs[1][2] == 9
    # nbdist drew the 15 batches the fit used (Keras on TensorFlow draws a few more ahead, into its prefetch)
    np.testing.assert_array_equal(after, ip.user_ns["y"][448:452])
    # The magic line's --epochs is the fit's, for the batches drawn too: the second epoch's are the next 3
    ip.run_cell_magic("dist_train", "--workers 2 --ui none --epochs 2",
                      "model = mlp(5)\nhist = model.fit(repeating(32), steps_per_epoch=3, verbose=0)\n")
    got = ip.user_ns["hist"].history["loss"]
    ip.run_cell("model = mlp(5)\nhist = model.fit(repeating(32), steps_per_epoch=3, epochs=2, verbose=0)\n")
    np.testing.assert_allclose(got, ip.user_ns["hist"].history["loss"], rtol=1e-5)


VALIDATION_GENERATOR_CELL = """
import itertools
import keras
def labelled(n=None):  # batch k: 4 rows whose label is k
    for k in itertools.count() if n is None else range(n):
        yield np.full((4, 2), k, "float32"), np.full((4, 1), k, "float32")
def label_mean(y_true, y_pred):  # the loss is the batch's label: val_loss says which batches were read
    return keras.ops.mean(y_true, axis=-1) + 0.0 * keras.ops.mean(y_pred, axis=-1)
model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile("sgd", label_mean)
train = (labelled(),) if TRAIN_GEN else (np.zeros((48, 2), "float32"), np.zeros((48, 1), "float32"))
hist = model.fit(*train, **EPOCHS, verbose=0, validation_data=labelled(VAL_BATCHES), validation_steps=VAL_STEPS,
                 validation_freq=VAL_FREQ, **({"steps_per_epoch": 3} if TRAIN_GEN else {"batch_size": 8}))
"""


@pytest.mark.parametrize("train_gen, batches, steps, freq, expected", [
    (False, None, 3, 1, [1, 4 / 3, 5 / 3, 2]),  # each validation: the 2 batches Keras peeked, then the next one
    (True, None, 3, 2, [1, 4 / 3]),  # every 2nd epoch; the training data a generator too
    (False, 2, None, 1, [0.5] * 4),  # a generator of 2 batches: both, every time
    (False, None, 1, 1, [0.0] * 4),
    (False, None, 4, 1, [1.5, 2.5, 3.5]),  # no epochs in the fit: the magic line's --epochs 3 draws for 3
])
def test_a_generator_as_validation_data_validates_on_the_batches_keras_reads(ip, train_gen, batches, steps, freq,
                                                                              expected):
    """model.fit(..., validation_data=generator, validation_steps=V): each validation reads the batches Keras'
    generator adapter gives a new pass (it replays the 2 it peeked at, then reads on), dealt over the workers and
    merged: the loss is each batch's label, so val_loss tells which were read. (Keras on TensorFlow may skip a
    batch between passes, into its prefetch; JAX and torch read these: tests/unit/test_validation_generator.py.)"""
    on_line = len(expected) == 3
    ip.user_ns.update(np=np, TRAIN_GEN=train_gen, VAL_BATCHES=batches, VAL_STEPS=steps, VAL_FREQ=freq,
                      EPOCHS={} if on_line else {"epochs": 4})
    ip.run_cell_magic("dist_train", "--workers 2 --ui none" + " --epochs 3" * on_line, VALIDATION_GENERATOR_CELL)
    np.testing.assert_allclose(ip.user_ns["hist"].history["val_loss"], expected, rtol=1e-6)


# -- averaging with K > 1: what it is ----------------------------------------------------------------
def sparse_model(optimizer: Any) -> Any:
    """The issue's Embedding model: its gradient is a tf.IndexedSlices of the rows a batch holds."""
    keras.utils.set_random_seed(11)
    model = keras.Sequential([keras.Input((12,), dtype="int32"), keras.layers.Embedding(50, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(2, activation="softmax")])
    model.compile(optimizer, "sparse_categorical_crossentropy")
    return model


def averaged_state(model: Any) -> list[Any]:
    """The optimizer's float state nbdist averages: slots (Adam's m and v), not the step count."""
    return [v for v in model.optimizer.variables
            if "float" in str(v.dtype) and v.path.rsplit("/", 1)[-1] not in ("iteration", "iterations")]


def rounds_of_local_adam(model: Any, shards: list[tuple[np.ndarray, np.ndarray]], batch: int, k: int) -> None:
    """Averaging by hand: from the shared weights AND optimizer slots, each worker runs ``k`` of its own
    steps (its Adam, its batches), then weights and slots are averaged, weighted by the rows each saw."""
    steps = lambda m: int(m.optimizer.iterations)
    rounds = max(-(-len(sx) // (k * batch)) for sx, _ in shards)
    start = [w.copy() for w in model.get_weights()]
    start_slots = [np.array(v.numpy()) for v in averaged_state(model)]
    for r in range(rounds):
        total, acc, acc_slots, first = 0, [0.0] * len(start), [0.0] * len(start_slots), steps(model)
        for sx, sy in shards:
            part = slice(r * k * batch, (r + 1) * k * batch)
            rows = len(sx[part])
            model.set_weights(start)
            for v, s in zip(averaged_state(model), start_slots):
                v.assign(s)
            model.optimizer.iterations.assign(first)  # each worker counts the same steps
            model.fit(sx[part], sy[part], batch_size=batch, epochs=1, shuffle=False, verbose=0)
            acc = [a + rows * w.astype(np.float64) for a, w in zip(acc, model.get_weights())]
            acc_slots = [a + rows * np.array(v.numpy(), np.float64) for a, v in zip(acc_slots, averaged_state(model))]
            total += rows
        start = [(a / total).astype(np.float32) for a in acc]
        start_slots = [(a / total).astype(np.float32) for a in acc_slots]
    model.set_weights(start)
    for v, s in zip(averaged_state(model), start_slots):
        v.assign(s)


def test_averaging_every_k_steps_is_local_adam_then_the_weighted_average_of_weights_and_slots():
    """Averaging with K=3 and Adam on an Embedding (sparse gradients): each worker takes 3 Adam steps of its
    own from the shared weights and slots, then every weight (an Embedding row that only one worker's
    batches held is averaged like any other weight, by rows: it moves by that worker's share) and every
    slot (m, v) is the row-weighted average; the step count is the steps taken. Equal to that done by
    hand, to 1e-5 (docs/keras-cell.md: what averaging with K > 1 is, against local Adam)."""
    rng = np.random.default_rng(3)
    x = rng.integers(0, 50, (256, 12)).astype("int32")
    y = (x[:, 0] % 2).astype("int32")
    local, remote = sparse_model(keras.optimizers.Adam(0.01)), sparse_model(keras.optimizers.Adam(0.01))
    remote.set_weights(local.get_weights())
    local.optimizer.build(local.trainable_variables)
    # Each global batch of 32 rows is dealt in order: its first 16 rows to worker 0, the next 16 to worker 1.
    dealt = [np.arange(256).reshape(8, 2, 16)[:, w].ravel() for w in range(2)]
    rounds_of_local_adam(local, [(x[rows], y[rows]) for rows in dealt], batch=16, k=3)
    job = nbdist.train(remote, x, y, epochs=1, batch_size=16, workers=2, strategy="averaging",
                       averaging_frequency=3, shuffle=False, lr_scaling="none")
    assert job.reports[0]["rounds"] == 3  # 8 batches per worker: after the 3rd, 6th and 8th
    for a, b in zip(remote.get_weights(), local.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(averaged_state(remote), averaged_state(local)):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7, err_msg=a.path)
    assert int(remote.optimizer.iterations) == int(local.optimizer.iterations) == 8
