"""Allreduce strategy end to end: real worker processes, real TensorFlow, scikit-learn digits.

The reference is local training on the same examples in the same order, where local
batch j is the concatenation of every worker's batch j (a shorter shard simply has
no batch j at the end). With plain SGD that is exactly what synchronous allreduce
computes, so parameters must match to 1e-5 relative.

The `digits` fixture (scikit-learn digits, scaled to [0, 1]) comes from conftest.py.
"""

import keras
import numpy as np
import pytest

import nbdist
from nbdist.errors import NbdistError

pytestmark = pytest.mark.timeout(240)


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10, activation="softmax")])


def cnn(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                             keras.layers.MaxPooling2D(), keras.layers.Flatten(),
                             keras.layers.Dense(10, activation="softmax")])


def compiled(model, optimizer):
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def global_batches(n, workers, batch_size):
    """Row indices of each synchronous step: global batch j, dealt over the workers (data.deal_rows)."""
    step = workers * batch_size
    return [np.arange(i, min(i + step, n)) for i in range(0, n, step)]


def local_reference(build, optimizer, x, y, workers, batch_size, epochs):
    model = compiled(build(), optimizer)
    for _ in range(epochs):
        for idx in global_batches(len(x), workers, batch_size):
            model.train_on_batch(x[idx], y[idx])
    return model


def assert_same_parameters(got, want, rtol=1e-5):
    for a, b in zip(got.get_weights(), want.get_weights()):
        assert np.linalg.norm(a - b) <= rtol * np.linalg.norm(b), (np.abs(a - b).max(), np.abs(b).max())


def accuracy(model, x, y):
    return float(np.mean(np.argmax(model.predict(x, verbose=0), axis=1) == y))


@pytest.mark.parametrize("direct_sum_bytes,shared_memory,summed_by",
                         [(4 * 2**20, True, "shared"), (4 * 2**20, False, "allreduce"), (0, True, "shared-chunked")])
def test_allreduce_two_workers_with_batch_b_equal_local_fit_with_batch_2b(digits, direct_sum_bytes, shared_memory,
                                                                           summed_by):
    """C3: 2 allreduce workers with batch b and SGD end with the parameters of a local fit with batch 2b."""
    x, y = digits
    model = compiled(mlp(), keras.optimizers.SGD(0.1))
    job = nbdist.train(model, x, y, epochs=1, batch_size=16, workers=2, strategy="allreduce", shuffle=False,
                       lr_scaling="none", direct_sum_bytes=direct_sum_bytes, shared_memory=shared_memory)
    ref = local_reference(mlp, keras.optimizers.SGD(0.1), x, y, workers=2, batch_size=16, epochs=1)
    assert_same_parameters(model, ref)
    assert set(job.history) == {"loss", "accuracy"} and len(job.history["loss"]) == 1
    assert all(w.sync_seconds > 0 for w in job.state.workers)  # time inside the allreduce is reported
    # Keras' train step scaled the loss (scale_loss): the MLP's small bucket was summed through one row of
    # shared memory (both workers are on this machine), or with that off by Gloo's allreduce, or, with
    # small sums off, chunk by chunk through shared memory, reading the gradients uncopied.
    assert [r["summed_by"] for r in job.reports.values()] == [summed_by, summed_by]


class OwnStepModel(keras.Sequential):
    """A notebook's model class with a train_step that never calls ``optimizer.scale_loss``."""

    def train_step(self, data):
        import tensorflow as tf

        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return self.compute_metrics(x, y, y_pred)


OwnStepModel.__module__ = "__main__"  # as if defined in a notebook: nbdist ships the class to workers
keras.saving.register_keras_serializable(package="nbdist_tests")(OwnStepModel)


def own_step_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return OwnStepModel([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                         keras.layers.Dense(10, activation="softmax")])


def test_allreduce_equals_local_fit_for_a_train_step_that_does_not_scale_the_loss(digits):
    """C3 for a notebook model whose own ``train_step`` never calls ``optimizer.scale_loss``."""
    # Without scale_loss the gradients arrive unweighted: nbdist weights them while copying them
    # into the bucket instead, and the average is the same (here summed by chunked Gloo allreduces,
    # the path between machines).
    x, y = digits
    x, y = x[:1000], y[:1000]
    model = compiled(own_step_mlp(), keras.optimizers.SGD(0.1))
    job = nbdist.train(model, x, y, epochs=1, batch_size=16, workers=2, strategy="allreduce", shuffle=False,
                       lr_scaling="none", direct_sum_bytes=0, shared_memory=False)
    ref = local_reference(own_step_mlp, keras.optimizers.SGD(0.1), x, y, workers=2, batch_size=16, epochs=1)
    assert_same_parameters(model, ref)
    assert [r["summed_by"] for r in job.reports.values()] == ["allreduce", "allreduce"]


def test_four_allreduce_workers_with_uneven_shards_match_local_adam_and_validate(digits):
    # 1497 rows / 4 workers = 375, 374, 374, 374: with batch 34 worker 0 has 12 batches, the others 11,
    # so they run one zero-sample step per epoch and must neither hang nor drift apart.
    # (2-worker MLP parity: the C3 test above shows equal parameters, hence equal accuracy.)
    x, y = digits
    xt, yt, xv, yv = x[:1497], y[:1497], x[1497:], y[1497:]
    assert [len(b) for b in global_batches(1497, 4, 34)][-2:] == [136, 1]
    model = compiled(mlp(2), keras.optimizers.Adam(0.01))
    job = nbdist.train(model, xt, yt, validation_data=(xv, yv), epochs=6, batch_size=34, workers=4,
                       strategy="allreduce", shuffle=False, lr_scaling="none")
    ref = local_reference(lambda: mlp(2), keras.optimizers.Adam(0.01), xt, yt, 4, 34, epochs=6)
    assert_same_parameters(model, ref, rtol=1e-4)
    got, want = accuracy(model, xv, yv), accuracy(ref, xv, yv)
    assert want > 0.85 and abs(got - want) <= 0.01, (got, want)
    assert len(job.history["val_accuracy"]) == 6
    assert abs(job.history["val_accuracy"][-1] - got) < 1e-6  # validation ran on the final weights


def test_cnn_accuracy_parity_and_horovod_is_refused_in_one_sentence(digits):
    x, y = digits
    x = x.reshape(-1, 8, 8, 1)
    xt, yt, xv, yv = x[:1500], y[:1500], x[1500:], y[1500:]
    model = compiled(cnn(), keras.optimizers.Adam(0.01))
    with pytest.raises(NbdistError, match="^--engine horovod is gone: Horovod 0.28.1"):
        nbdist.train(model, xt, yt, epochs=4, batch_size=32, workers=2, strategy="allreduce", engine="horovod")
    nbdist.train(model, xt, yt, epochs=4, batch_size=32, workers=2, strategy="allreduce", shuffle=False,
                 lr_scaling="none")
    ref = local_reference(cnn, keras.optimizers.Adam(0.01), xt, yt, 2, 32, epochs=4)
    got, want = accuracy(model, xv, yv), accuracy(ref, xv, yv)
    assert want > 0.8 and abs(got - want) <= 0.01, (got, want)


def test_magic_trains_with_allreduce(digits):
    from ..conftest import ipython_shell

    x, y = digits
    shell = ipython_shell()
    shell.user_ns.update(X=x[:1500], y=y[:1500], Xv=x[1500:], yv=y[1500:], keras=keras)
    cell = ("keras.utils.set_random_seed(3)\n"
            "net = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation='relu'),\n"
            "                        keras.layers.Dense(10, activation='softmax')])\n"
            "net.compile(keras.optimizers.Adam(0.01), 'sparse_categorical_crossentropy', metrics=['accuracy'])\n")
    before = [w.copy() for w in shell.run_cell(cell).success and shell.user_ns["net"].get_weights()]
    shell.run_cell_magic("dist_train", "--data X,y --validation-data Xv,yv --epochs 3 --batch-size 32 "
                         "--workers 2 --strategy allreduce --engine gloo --ui none --out hist", cell)
    hist, net = shell.user_ns["hist"], shell.user_ns["net"]
    assert len(hist["val_accuracy"]) == 3 and hist["val_accuracy"][-1] > 0.8
    assert any(not np.allclose(a, b) for a, b in zip(net.get_weights(), before))
    assert abs(accuracy(net, x[1500:], y[1500:]) - hist["val_accuracy"][-1]) < 1e-6


def test_one_allreduce_worker_trains_with_keras_own_step_and_reports_its_device(digits):
    """Issue 36: with one worker nothing is summed, so no gradient leaves the step (no hook, no host copy,
    no collective: 0 rounds, engine "none"), and the weights are the local fit's; the worker says where it
    trained, in its report and the run's state (no GPU here: "CPU")."""
    x, y = digits
    x, y = x[:512], y[:512]
    model = compiled(mlp(4), keras.optimizers.Adam(0.01))
    job = nbdist.train(model, x, y, epochs=2, batch_size=32, workers=1, strategy="allreduce", shuffle=False,
                       lr_scaling="none", ui="none")
    ref = local_reference(lambda: mlp(4), keras.optimizers.Adam(0.01), x, y, workers=1, batch_size=32, epochs=2)
    assert_same_parameters(model, ref, rtol=1e-6)
    report = job.reports[0]
    assert (report["engine"], report["rounds"], report["summed_by"], report["device"]) == ("none", 0, None, "CPU")
    assert job.state.workers[0].device == "CPU"


def mixed_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu", dtype="mixed_float16"),
                             keras.layers.Dense(10, activation="softmax", dtype="float32")])


def max_gap(a, b):
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


@pytest.mark.parametrize("precision", ["float32", "mixed_float16"])
def test_tensorflow_device_sum_equals_the_numpy_exchange_and_the_local_fit_with_pad_steps(digits,
                                                                                           precision):
    """Issue 36, TensorFlow: 2 workers summing their gradients as tensors (DLPack into torch's buckets, the GPU's
    code, over Gloo here: device_sum="always"; buckets of 1 KiB, 4 for this MLP) train the weights of the
    default numpy exchange, and of the local fit on the global batch; shares of 257 and 256 rows, so worker 1
    joins each epoch's last step with zeros (a pad step). mixed_float16: a LossScaleOptimizer's scaled
    gradients summed and unscaled as through the numpy exchange."""
    x, y = digits
    x, y = x[:513], y[:513]
    build = mlp if precision == "float32" else mixed_mlp
    # SGD: its step is proportional to the gradient, so a wrong weight shows (Adam's would hide a constant one).
    optimizer = (lambda: keras.optimizers.SGD(0.1)) if precision == "float32" else (
        lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)))
    args = {"epochs": 2, "batch_size": 32, "workers": 2, "strategy": "allreduce", "shuffle": False,
            "lr_scaling": "none", "ui": "none"}
    numpy_sum = compiled(build(), optimizer())
    numpy_job = nbdist.train(numpy_sum, x, y, **args)
    device = compiled(build(), optimizer())
    job = nbdist.train(device, x, y, device_sum="always", bucket_bytes=1024, **args)
    reports = [job.reports[r] for r in range(2)]
    assert [(r["summed_by"], r["engine"], r["padded_steps"]) for r in reports] == [
        ("device", "gloo", 0), ("device", "gloo", 2)], reports
    assert [numpy_job.reports[r]["summed_by"] for r in range(2)] == ["shared", "shared"]
    assert max_gap(device, numpy_sum) <= 1e-6, max_gap(device, numpy_sum)
    np.testing.assert_allclose(job.history["loss"], numpy_job.history["loss"], rtol=1e-6)
    if precision == "float32":  # float16's rounding differs between a batch of 32 and one of 64
        ref = local_reference(mlp, keras.optimizers.SGD(0.1), x, y, workers=2, batch_size=32, epochs=2)
        assert_same_parameters(device, ref, rtol=1e-5)


def test_tensorflow_device_average_equals_the_local_fit_every_step_and_the_host_average_with_pad_rounds(
        digits):
    """Issue 36, TensorFlow's averaging rounds on the device (``TFTensors``: the variables by DLPack into
    torch's buckets, the GPU's code, over Gloo here: device_sum="always"; buckets of 1 KiB, 4 for this MLP).
    Shares of 257 and 256 rows: with SGD averaged every step, worker 1 joins each epoch's last round with no
    samples and the run is the local fit on the global batch (weights to 1e-5, same history); averaged every 2
    steps (worker 0: 5 rounds an epoch, worker 1: 4 and a pad round), it equals the host's ``WeightedAverager``."""
    x, y = digits
    x, y = x[:513], y[:513]
    args = {"epochs": 2, "batch_size": 32, "workers": 2, "strategy": "averaging", "shuffle": False,
            "lr_scaling": "none", "ui": "none"}
    host = compiled(mlp(), keras.optimizers.SGD(0.1))
    host_job = nbdist.train(host, x, y, averaging_frequency=2, **args)
    args_device = {**args, "device_sum": "always", "bucket_bytes": 1024}
    every_step = compiled(mlp(), keras.optimizers.SGD(0.1))
    job = nbdist.train(every_step, x, y, averaging_frequency=1, **args_device)
    assert [job.reports[r]["summed_by"] for r in range(2)] == ["device", "device"]
    local = compiled(mlp(), keras.optimizers.SGD(0.1))
    expected = local.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
    assert_same_parameters(every_step, local, rtol=1e-5)
    for key, values in expected.items():
        np.testing.assert_allclose(job.history[key], values, rtol=1e-5, atol=1e-7, err_msg=key)
    device = compiled(mlp(), keras.optimizers.SGD(0.1))
    device_job = nbdist.train(device, x, y, averaging_frequency=2, **args_device)
    reports = [device_job.reports[r] for r in range(2)]
    assert [(r["summed_by"], r["rounds"]) for r in reports] == [("device", 10), ("device", 10)], reports
    assert [host_job.reports[r]["summed_by"] for r in range(2)] == ["shared", "shared"]
    assert max_gap(device, host) <= 1e-6, max_gap(device, host)
    np.testing.assert_allclose(device_job.history["loss"], host_job.history["loss"], rtol=1e-6)
