"""Distributed evaluate/predict vs local Keras on generated data: time ratios and exactness.

Prints one table measured in one run. Worker start (importing TensorFlow) dominates at
small sizes; the ratio column says what the distribution costs on this machine.
Usage: python benchmarks/evaluate_overhead.py [rows]
"""
from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

import nbdist


def main(rows: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 64)).astype("float32")
    y = (x[:, :10] @ rng.normal(size=(10, 10))).argmax(axis=1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x[:5000], y[:5000], epochs=1, verbose=0)

    t = time.perf_counter()
    local = model.evaluate(x, y, batch_size=256, verbose=0, return_dict=True)
    local_eval = time.perf_counter() - t
    t = time.perf_counter()
    local_pred = model.predict(x, batch_size=256, verbose=0)
    local_predict = time.perf_counter() - t

    print(f"{rows} rows x 64 features, 10 classes; local evaluate {local_eval:.2f} s, predict {local_predict:.2f} s")
    print(f"{'run':<22}{'seconds':>9}{'x local':>9}{'|loss diff|':>13}{'|acc diff|':>12}{'max |pred diff|':>17}")
    for workers in (1, 2):
        t = time.perf_counter()
        res = nbdist.evaluate(model, x, y, workers=workers, batch_size=256)
        sec = time.perf_counter() - t
        print(f"{'evaluate, ' + str(workers) + ' worker(s)':<22}{sec:>9.2f}{sec / local_eval:>9.1f}"
              f"{abs(res['loss'] - local['loss']):>13.2e}{abs(res['accuracy'] - local['accuracy']):>12.2e}{'':>17}")
        t = time.perf_counter()
        pred = nbdist.predict(model, x, workers=workers, batch_size=256)
        sec = time.perf_counter() - t
        print(f"{'predict, ' + str(workers) + ' worker(s)':<22}{sec:>9.2f}{sec / local_predict:>9.1f}"
              f"{'':>13}{'':>12}{np.abs(pred - local_pred).max():>17.2e}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50_000)
