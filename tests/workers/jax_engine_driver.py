"""A notebook on Keras' JAX backend training with ``--engine jax`` (the sum inside the jitted step, over JAX's
own collectives): backend_driver.py's phase ``jax_engine`` (or ``python jax_engine_driver.py``, which prints
the JSON line test_backends.py reads).
Digits, 2 workers, 2 epochs, SGD and Adam, each beside the local fit on the global batch; uneven shares (the
host path, said once); the averaging strategy's rounds inside the JAX job; then a run whose worker 1 dies in its
second epoch, timed."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"

import keras
import numpy as np
from sklearn.datasets import load_digits

import nbdist

ROWS, GLOBAL_BATCH, EPOCHS = 512, 64, 2


def mlp(optimizer: object) -> keras.Model:
    init = keras.initializers.GlorotUniform
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu", kernel_initializer=init(0)),
                              keras.layers.Dense(10, activation="softmax", kernel_initializer=init(1))])
    model.compile(optimizer, "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main() -> dict[str, object]:
    features, labels = load_digits(return_X_y=True)
    x, y = (features[:ROWS] / 16).astype("float32"), labels[:ROWS].astype("int64")
    fit_args = {"epochs": EPOCHS, "shuffle": False, "validation_split": 0.25}
    out: dict[str, object] = {}
    for name, make in (("sgd", lambda: keras.optimizers.SGD(0.1)), ("adam", lambda: keras.optimizers.Adam(0.01))):
        local = mlp(make())
        expected = local.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0, **fit_args).history
        remote = mlp(make())
        job = nbdist.train(remote, x, y, workers=2, strategy="allreduce", engine="jax", lr_scaling="none", ui="none",
                           batch_size=GLOBAL_BATCH // 2, **fit_args)
        out[name] = {"history": job.fit_history.history, "expected": expected,
                     "weight_gap": max(float(np.abs(u - v).max()) for u, v in zip(remote.get_weights(),
                                                                                   local.get_weights())),
                     "engines": [job.reports[r].get("engine") for r in sorted(job.reports)],
                     "summed_by": [job.reports[r].get("summed_by") for r in sorted(job.reports)]}
    # BatchNorm (its moving statistics, averaged over the workers at each epoch's end) and Dropout (each
    # worker's seed state): the same run through the host call and through JAX's collective. SGD: with Adam
    # the two orders of summation end 4e-4 apart (its update is ~lr*sign(g) where g is near zero).
    def bn_dropout() -> keras.Model:
        init = keras.initializers.GlorotUniform
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, kernel_initializer=init(0)),
                                  keras.layers.BatchNormalization(), keras.layers.Activation("relu"),
                                  keras.layers.Dropout(0.2, seed=3),
                                  keras.layers.Dense(10, activation="softmax", kernel_initializer=init(1))])
        model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
        return model

    runs = {}
    for engine in ("gloo", "jax"):
        runs[engine] = bn_dropout()
        job = nbdist.train(runs[engine], x, y, workers=2, strategy="allreduce", engine=engine, lr_scaling="none",
                           ui="none", batch_size=GLOBAL_BATCH // 2, seed=7, **fit_args)
        out[f"bn_{engine}"] = {"history": job.fit_history.history,
                               "engines": [job.reports[r].get("engine") for r in sorted(job.reports)]}
    out["bn_gap"] = max(float(np.abs(u - v).max()) for u, v in zip(runs["jax"].get_weights(),
                                                                    runs["gloo"].get_weights()))
    # Uneven shares (375 training rows: 188 and 187): one program cannot serve both, so one sentence and Gloo.
    local = mlp(keras.optimizers.SGD(0.1))
    expected = local.fit(x[:500], y[:500], batch_size=GLOBAL_BATCH, verbose=0, **fit_args).history
    remote = mlp(keras.optimizers.SGD(0.1))
    job = nbdist.train(remote, x[:500], y[:500], workers=2, strategy="allreduce", engine="jax", lr_scaling="none",
                       ui="none", batch_size=GLOBAL_BATCH // 2, **fit_args)
    out["uneven"] = {"history": job.fit_history.history, "expected": expected, "warnings": sorted(job._warned),
                     "weight_gap": max(float(np.abs(u - v).max()) for u, v in zip(remote.get_weights(),
                                                                                   local.get_weights())),
                     "engines": [job.reports[r].get("engine") for r in sorted(job.reports)]}
    # The averaging strategy's rounds inside the JAX job (device_sum="always": the GPUs' code path over Gloo).
    # Every step with SGD: the local step on the global batch. Every 3 steps on uneven shares (a round where
    # worker 1 has trained nothing), BatchNorm and Dropout: what the host's rounds train.
    def average(model: keras.Model, data: int, k: int, device: bool) -> dict[str, object]:
        job = nbdist.train(model, x[:data], y[:data], workers=2, strategy="averaging", averaging_frequency=k,
                           lr_scaling="none", ui="none", batch_size=GLOBAL_BATCH // 2, seed=7,
                           device_sum="always" if device else "auto", **fit_args)
        return {"history": job.fit_history.history,
                "summed_by": [job.reports[r].get("summed_by") for r in sorted(job.reports)]}

    local, remote = mlp(keras.optimizers.SGD(0.1)), mlp(keras.optimizers.SGD(0.1))
    expected = local.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0, **fit_args).history
    out["average"] = {**average(remote, ROWS, 1, True), "expected": expected,
                      "weight_gap": max(float(np.abs(u - v).max()) for u, v in zip(remote.get_weights(),
                                                                                    local.get_weights()))}
    models = {True: bn_dropout(), False: bn_dropout()}
    out["average_uneven"] = {str(device): average(models[device], 500, 3, device) for device in (True, False)}
    out["average_uneven_gap"] = max(float(np.abs(u - v).max()) for u, v in zip(models[True].get_weights(),
                                                                                models[False].get_weights()))
    # Worker 1 killed after the first epoch: the survivor's next sum must not hang the run.
    from nbdist.api import prepare
    from nbdist.config import TrainConfig
    from nbdist.errors import TrainingFailed

    killed: dict[str, float] = {}

    def kill_after_first_epoch(kind: str, state: object, payload: object) -> None:
        if kind == "epoch" and not killed:
            killed["at"] = time.monotonic()
            os.kill(state.workers[1].pid, signal.SIGKILL)

    job = prepare(mlp(keras.optimizers.SGD(0.1)), TrainConfig(epochs=200, workers=2, strategy="allreduce",
                                                               engine="jax", ui="none", batch_size=GLOBAL_BATCH // 2),
                  x, y, None, listeners=[kill_after_first_epoch])
    job.start()
    try:
        job.wait(timeout=120)
        out["dead"] = {"error": None}
    except TrainingFailed as exc:
        out["dead"] = {"error": str(exc)[:400], "seconds": time.monotonic() - killed["at"], "status": job.status}
    return out


if __name__ == "__main__":
    print("NBDIST-RESULT " + json.dumps(main()), flush=True)
    sys.exit(0)
