"""Elephas's side of P3, run by the Python of Elephas's own virtual environment.

It imports nothing from nbdist (that venv has TensorFlow < 2.20 and numpy < 2, which
nbdist does not support). Trains the digits MLP with Elephas's documented workflow,
``SparkModel(model, frequency="epoch", mode="synchronous", num_workers=N).fit(rdd, ...)``,
on Spark local[N], and prints one JSON line: fit seconds and test accuracy. With ``--pause S`` a
second fit of a new model follows S seconds later on the same SparkContext, as a notebook's next
cell would: its time is ``warm_seconds``.

    ELEPHAS_PYTHON benchmarks/elephas_digits.py DATA.npz --epochs 15 --workers 2 [--pause 10]
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("data", help=".npz with x_train, y_train, x_test, y_test")
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pause", type=float, default=None, help="then a second fit this many seconds later")
    args = p.parse_args()

    import numpy as np
    from elephas_spark import local_spark_context

    sc = local_spark_context(args.workers, "elephas-digits")
    try:
        import keras
        from elephas.spark_model import SparkModel
        from elephas.utils.rdd_utils import to_simple_rdd

        d = np.load(args.data)

        def fit_once() -> tuple[float, float]:
            keras.utils.set_random_seed(args.seed)
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                      keras.layers.Dense(10, activation="softmax")])
            model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
            rdd = to_simple_rdd(sc, d["x_train"], d["y_train"])
            spark_model = SparkModel(model, frequency="epoch", mode="synchronous", num_workers=args.workers)
            t0 = time.perf_counter()
            spark_model.fit(rdd, epochs=args.epochs, batch_size=args.batch_size, verbose=0, validation_split=0.0)
            seconds = time.perf_counter() - t0
            _, accuracy = spark_model.master_network.evaluate(d["x_test"], d["y_test"], verbose=0)
            return seconds, float(accuracy)

        seconds, accuracy = fit_once()
        warm_seconds = None
        if args.pause is not None:
            time.sleep(args.pause)
            warm_seconds, _ = fit_once()
    finally:
        sc.stop()
    import elephas

    print(json.dumps({"seconds": seconds, "warm_seconds": warm_seconds, "accuracy": accuracy,
                      "elephas": getattr(elephas, "__version__", "7.3"), "tensorflow": _tf_version()}))
    return 0


def _tf_version() -> str:
    import tensorflow as tf

    return tf.__version__


if __name__ == "__main__":
    raise SystemExit(main())
