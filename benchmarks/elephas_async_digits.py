"""Elephas's side of P13, run by the Python of Elephas's own virtual environment (see elephas_compare.py).

Imports nothing from nbdist. On Spark local[N] it trains P12's digits MLP (Dense 32, Adam 0.01, batch 64)
with Elephas 7.3's asynchronous parameter server, ``AsynchronousSparkModel(model, mode=M, frequency="epoch")``
(Elephas's default HTTP server on port 4000), for each mode asked, with and without one slow partition,
and prints one JSON line: per run, the fit's wall time and the test accuracy of the master network.

The slowdown is P12's: every 64-row batch costs PAUSE seconds, three times as long in partition 1. Elephas
passes fit's keyword arguments to each worker's ``model.fit``, so a Keras callback sleeps after each batch
in the task whose ``TaskContext.partitionId()`` says which partition it trains. A one-epoch synchronous fit
first warms the session (the executors' Python workers import TensorFlow once), as nbdist's side does.

Note: in Elephas 7.3 ``SparkModel(model, mode="asynchronous")`` stores ``mode`` and trains synchronously;
the asynchronous mode is the class ``AsynchronousSparkModel``.

    ELEPHAS_PYTHON benchmarks/elephas_async_digits.py DATA.npz --epochs 10 --modes asynchronous,hogwild
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
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--pause", type=float, default=0.06, help="seconds per batch; 3x in partition 1 when slowed")
    p.add_argument("--modes", default="asynchronous,hogwild",
                   help="comma-separated: asynchronous, hogwild, synchronous")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()

    import numpy as np
    from elephas_spark import local_spark_context
    from pyspark import TaskContext

    sc = local_spark_context(args.workers, "elephas-async-digits")
    runs: list[dict] = []
    try:
        import keras
        from elephas.spark_model import AsynchronousSparkModel, SparkModel
        from elephas.utils.rdd_utils import to_simple_rdd

        class Pause(keras.callbacks.Callback):
            """Sleeps after each batch a worker trains: ``pause`` s, ``slow`` times as long in partition 1."""

            def __init__(self, pause: float, slow: float) -> None:
                super().__init__()
                self.pause, self.slow = pause, slow

            def on_train_batch_end(self, batch, logs=None):
                ctx = TaskContext.get()
                time.sleep(self.pause * (self.slow if ctx is not None and ctx.partitionId() == 1 else 1))

        d = np.load(args.data)

        def fit(mode: str, epochs: int, slow: float) -> dict:
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                      keras.layers.Dense(10, activation="softmax")])
            model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
            rdd = to_simple_rdd(sc, d["x_train"], d["y_train"])
            if mode == "synchronous":
                spark_model = SparkModel(model, num_workers=args.workers)
            else:
                spark_model = AsynchronousSparkModel(model, mode=mode, frequency="epoch", num_workers=args.workers)
            t0 = time.perf_counter()
            spark_model.fit(rdd, epochs=epochs, batch_size=64, verbose=0, validation_split=0.0,
                            callbacks=[Pause(args.pause, slow)])
            seconds = time.perf_counter() - t0
            _, accuracy = spark_model.master_network.evaluate(d["x_test"], d["y_test"], verbose=0)
            return {"mode": mode, "slowed": slow != 1, "seconds": seconds, "accuracy": float(accuracy)}

        fit("synchronous", 1, 1.0)  # warm-up, not reported
        for _ in range(args.repeats):
            for slow in (1.0, 3.0):
                for mode in args.modes.split(","):
                    try:
                        runs.append(fit(mode, args.epochs, slow))
                    except Exception as exc:  # recorded in the row, as P3 records Connect
                        runs.append({"mode": mode, "slowed": slow != 1, "error": f"{type(exc).__name__}: {exc}"[:300]})
    finally:
        sc.stop()
    import elephas
    import tensorflow as tf

    print(json.dumps({"runs": runs, "elephas": getattr(elephas, "__version__", "7.3.0"), "tensorflow": tf.__version__}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
