"""A finite tf.data pipeline or a torch DataLoader over tensors where in-memory data goes: read once in the
notebook into the arrays it yields, with its batch size as the global batch and its shuffle as the per-epoch
shuffle (nbdist/data/pipelines.py)."""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import nbdist

from ..conftest import mlp, relative_error


def test_the_cells_fit_on_a_pipeline_equals_the_local_fit_on_it(ip, digits):
    """model.fit(ds, validation_data=val_ds) in the cell, two workers under allreduce with SGD: the local
    step on each of the pipeline's batches, its validation merged exactly."""
    x, y = digits[0][:512], digits[1][:512]
    xv, yv = digits[0][600:760], digits[1][600:760]
    weights = np.random.default_rng(0).uniform(0.5, 2.0, len(x)).astype("float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(64).prefetch(2)
    val = tf.data.Dataset.from_tensor_slices((xv, yv)).batch(50)
    local = mlp(seed=2, optimizer=keras.optimizers.SGD(0.1))
    remote = mlp(seed=2, optimizer=keras.optimizers.SGD(0.1))
    remote.set_weights(local.get_weights())
    expected = local.fit(ds, validation_data=val, epochs=2, verbose=0).history
    ip.user_ns.update(remote=remote, ds=ds, val=val)
    ip.run_cell_magic("dist_train", "--workers 2 --strategy allreduce --backend local --ui none",
                      "fitted = remote.fit(ds, validation_data=val, epochs=2, verbose=0)\n")
    err = relative_error(remote.get_weights(), local.get_weights())
    assert err < 1e-5, err
    for key in ("loss", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(ip.user_ns["fitted"].history[key], expected[key], rtol=1e-5, err_msg=key)


def test_evaluate_and_predict_take_a_pipeline_as_keras_does(digits):
    x, y = digits
    model = mlp(seed=1)
    model.fit(x[:400], y[:400], epochs=2, verbose=0)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(100)
    merged = nbdist.evaluate(model, ds, workers=2, backend="local")
    here = model.evaluate(ds, verbose=0, return_dict=True)
    for name, value in here.items():
        assert merged[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    predicted = nbdist.predict(model, tf.data.Dataset.from_tensor_slices(x).batch(100), workers=2, backend="local")
    np.testing.assert_allclose(predicted, model.predict(x, verbose=0), atol=1e-6)


def test_a_torch_loader_over_tensors_trains_as_the_local_fit_on_it(digits):
    """Keras' fit takes a torch DataLoader on every backend; nbdist.train on one equals the local fit to 1e-5."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    x, y = digits[0][:512], digits[1][:512]
    loader = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=64, shuffle=False)
    local = mlp(seed=4, optimizer=keras.optimizers.SGD(0.1))
    remote = mlp(seed=4, optimizer=keras.optimizers.SGD(0.1))
    remote.set_weights(local.get_weights())
    expected = local.fit(loader, epochs=2, verbose=0).history
    job = nbdist.train(remote, loader, epochs=2, workers=2, strategy="allreduce", backend="local")
    err = relative_error(remote.get_weights(), local.get_weights())
    assert err < 1e-5, err
    np.testing.assert_allclose(job.fit_history.history["loss"], expected["loss"], rtol=1e-5)
