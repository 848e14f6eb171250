"""The issue's BatchNormalization case: a small BN CNN fitted with batch_size=32 under %%dist_train.

batch_size in an intercepted fit is the global batch (16 per worker here), so BN sees the batches
the local call would (the issue saw 0.10 against 0.86 when each worker took 32). BN's moving
mean/variance are not trained by gradients: each worker updates them from its own rows. Both
strategies leave them averaged over the workers, weighted by rows (averaging: with the weights every
K batches; allreduce: at each epoch end, before validation), so every worker validates with the same
statistics and the notebook's model holds those.
"""
from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

BN_CELL = """
import keras
keras.utils.set_random_seed(7)
model = keras.Sequential([
    keras.Input((8, 8, 1)),
    keras.layers.Conv2D(16, 3, padding="same", use_bias=False),
    keras.layers.BatchNormalization(),
    keras.layers.Activation("relu"),
    keras.layers.MaxPooling2D(),
    keras.layers.Flatten(),
    keras.layers.Dense(10, activation="softmax"),
])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
hist = model.fit(Xi, yi, batch_size=32, epochs=EPOCHS, validation_data=(Xiv, yiv), verbose=0)
"""


@pytest.mark.parametrize("strategy", ["averaging", "allreduce"])
def test_batchnorm_cnn_with_the_global_batch_matches_local(ip, digits_split, strategy):
    """Validation accuracy within 5 points of the same cell run locally (averaging every 5 batches
    with Adam lags it by 1-3 points at 5 epochs; the issue saw 76 points); the model's moving statistics
    are the ones every worker validated with (the notebook model's evaluate equals the merged
    val_accuracy), and they moved away from their initial 0 / 1."""
    x_train, x_test, y_train, y_test = digits_split
    image = lambda x: x.reshape(-1, 8, 8, 1)
    ip.user_ns.update(Xi=image(x_train), yi=y_train, Xiv=image(x_test), yiv=y_test, EPOCHS=5)
    ip.run_cell_magic("dist_train", f"--workers 2 --strategy {strategy} --seed 1 --ui none", BN_CELL)
    ns = ip.user_ns
    model, history = ns["model"], ns["hist"].history
    remote = model.evaluate(image(x_test), y_test, verbose=0, return_dict=True)["accuracy"]
    assert abs(remote - history["val_accuracy"][-1]) < 1e-6, (remote, history["val_accuracy"][-1])
    bn = next(layer for layer in model.layers if "batch_normalization" in layer.name)
    assert np.abs(bn.moving_mean.numpy()).max() > 0.05 and np.abs(bn.moving_variance.numpy() - 1).max() > 0.05
    ip.run_cell(BN_CELL)  # the same cell, locally
    local = ns["hist"].history["val_accuracy"][-1]
    assert abs(remote - local) <= 0.05, (strategy, remote, local)
