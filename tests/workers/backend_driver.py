"""A notebook on Keras' JAX or torch backend, as a separate process (issue 25): ``python backend_driver.py BACKEND``.

Keras reads ``KERAS_BACKEND`` once, when it is first imported, so each backend needs a process of its
own; ``test_backends.py`` runs this script and reads the JSON line it prints last. Everything a user
would do: the cell's own ``model.fit`` under ``%%dist_train`` (allreduce, Adam), ``nbdist.train`` with
averaging every step (plain SGD), ``nbdist.evaluate`` and ``nbdist.predict``, each beside the local Keras
call it must equal. Digits, 2 workers, 2 epochs.
"""
from __future__ import annotations

import json
import os
import sys

BACKEND = sys.argv[1]
os.environ["KERAS_BACKEND"] = BACKEND

import keras  # noqa: E402
import numpy as np  # noqa: E402
from IPython.core.interactiveshell import InteractiveShell  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import nbdist  # noqa: E402

ROWS, GLOBAL_BATCH, EPOCHS = 512, 64, 2


def mlp(optimizer: object) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def weight_gap(a: keras.Model, b: keras.Model) -> float:
    return max(float(np.abs(u - v).max()) for u, v in zip(a.get_weights(), b.get_weights()))


def main() -> dict[str, object]:
    features, labels = load_digits(return_X_y=True)
    features = (features / 16).astype("float32")
    x, y = features[:ROWS], labels[:ROWS].astype("int64")
    x_test, y_test = features[ROWS:ROWS + 300], labels[ROWS:ROWS + 300].astype("int64")
    fit_args = {"batch_size": GLOBAL_BATCH, "epochs": EPOCHS, "shuffle": False, "validation_split": 0.25}
    out: dict[str, object] = {"backend": keras.backend.backend(), "driver_tensorflow": "tensorflow" in sys.modules}

    # The cell's own model.fit under %%dist_train: allreduce equals the local step on the global batch.
    local = mlp(keras.optimizers.Adam(0.01))
    expected = local.fit(x, y, verbose=0, **fit_args).history
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.user_ns.update(X=x, y=y, mlp=mlp, keras=keras)
    shell.run_cell_magic("dist_train", "--workers 2 --strategy allreduce --lr-scaling none --ui none",
                         "model = mlp(keras.optimizers.Adam(0.01))\n"
                         "history = model.fit(X, y, batch_size=64, epochs=2, shuffle=False, validation_split=0.25)\n")
    model = shell.user_ns["model"]
    out["allreduce"] = {"history": shell.user_ns["history"].history, "expected": expected,
                        "weight_gap": weight_gap(model, local)}

    # nbdist.train, averaging after every step with plain SGD: the local step too.
    local_sgd = mlp(keras.optimizers.SGD(0.1))
    expected_sgd = local_sgd.fit(x, y, verbose=0, **fit_args).history
    remote_sgd = mlp(keras.optimizers.SGD(0.1))
    job = nbdist.train(remote_sgd, x, y, sample_weight=np.ones(len(y), "float32"), workers=2,
                       strategy="averaging", averaging_frequency=1, lr_scaling="none", ui="none",
                       **{k: v for k, v in fit_args.items() if k != "batch_size"}, batch_size=GLOBAL_BATCH // 2)
    out["averaging"] = {"history": job.fit_history.history, "expected": expected_sgd,
                        "weight_gap": weight_gap(remote_sgd, local_sgd),
                        "reports": {str(r): {k: job.reports[r].get(k) for k in ("keras_backend", "tensorflow_loaded")}
                                    for r in job.reports}}

    # Evaluation (merged metric state) and prediction (rows in order) of the model %%dist_train trained.
    out["evaluate"] = {"got": {k: float(v) for k, v in nbdist.evaluate(model, x_test, y_test, workers=2).items()
                               if k in ("loss", "accuracy")},
                       "expected": model.evaluate(x_test, y_test, verbose=0, return_dict=True)}
    predicted = nbdist.predict(model, x_test, workers=2)
    out["predict_gap"] = float(np.abs(np.asarray(predicted) - model.predict(x_test, verbose=0)).max())
    return out


if __name__ == "__main__":
    result = main()
    print("NBDIST-RESULT " + json.dumps(result, default=float), flush=True)
