"""Driver memory while training on a >= 1 GB Spark DataFrame: the rows must stay on the executors.

The DataFrame is generated on the executors (spark.range + rand columns), never on
the driver. We sample the notebook-side (Python driver) process's RSS during
training and print its growth next to the size of the data. Goal: < 100 MB.
In local mode the JVM is both Spark driver and executor, so its growth is shown
for information only.

    python benchmarks/driver_memory.py [--gb 1.0] [--workers 2]
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time

import psutil

FEATURES = 64


def start_spark(workers: int):
    """A local SparkSession whose executors run this Python."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{workers}]").appName("nbdist-driver-memory")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.pyspark.python", sys.executable).config("spark.driver.host", "127.0.0.1")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def measure(spark, gb: float = 1.0, workers: int = 2, batch_size: int = 2048) -> dict:
    """Train one epoch on a generated ``gb`` GB DataFrame; the driver's RSS before, at peak, and more."""
    from pyspark.sql import functions as F

    rows = int(gb * 1e9 / ((FEATURES + 1) * 8)) + 1
    # Generated per partition on the executors: nothing is built on the driver.
    features = F.array(*[F.rand(seed=i) for i in range(FEATURES)])
    df = (spark.range(0, rows, numPartitions=workers)
          .select(features.alias("features"))
          .withColumn("label", (F.aggregate("features", F.lit(0.0), lambda a, b: a + b) > FEATURES / 2).cast("int")))

    import keras

    import nbdist

    model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    me = psutil.Process()
    jvm = next((c for c in me.children(recursive=True) if "java" in c.name()), None)
    base = me.memory_info().rss
    jvm_base = jvm.memory_info().rss if jvm else 0
    peak, jvm_peak = [base], [jvm_base]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], me.memory_info().rss)
            if jvm is not None:
                jvm_peak[0] = max(jvm_peak[0], jvm.memory_info().rss)

    threading.Thread(target=sample, daemon=True).start()
    t0 = time.perf_counter()
    try:
        job = nbdist.train(model, df, features="features", label="label", epochs=1, batch_size=batch_size,
                           workers=workers, backend="spark")
    finally:
        done.set()
    seconds = time.perf_counter() - t0
    peak[0] = max(peak[0], me.memory_info().rss)
    return {"rows": rows, "data_mb": rows * (FEATURES + 1) * 8 / 1e6, "base_mb": base / 1e6,
            "peak_mb": peak[0] / 1e6, "growth_mb": (peak[0] - base) / 1e6,
            "jvm_growth_mb": (jvm_peak[0] - jvm_base) / 1e6, "seconds": seconds,
            "rows_trained": sum(w.samples for w in job.state.workers),
            "accuracy": job.history["accuracy"][-1]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="logical DataFrame size in GB (8-byte doubles)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2048)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spark = start_spark(args.workers)
    m = measure(spark, args.gb, args.workers, args.batch_size)
    growth_mb, data_mb = m["growth_mb"], m["data_mb"]
    table = [
        ("rows", f"{m['rows']:,}"),
        ("DataFrame size (8-byte values)", f"{data_mb:,.0f} MB"),
        ("driver RSS before training", f"{m['base_mb']:,.0f} MB"),
        ("driver RSS peak during training", f"{m['peak_mb']:,.0f} MB"),
        ("driver RSS growth", f"{growth_mb:,.1f} MB"),
        ("growth / data size", f"{growth_mb / data_mb:.4f}"),
        ("rows trained (sum over workers)", f"{m['rows_trained']:,}"),
        ("JVM RSS growth (local mode: also the executor)", f"{m['jvm_growth_mb']:,.0f} MB"),
        ("goal: growth < 100 MB", "met" if growth_mb < 100 else "NOT met"),
        ("training time (1 epoch, incl. partition counts)", f"{m['seconds']:,.1f} s"),
        ("final accuracy", f"{m['accuracy']:.3f}"),
    ]
    width = max(len(k) for k, _ in table)
    for key, value in table:
        print(f"{key:<{width}}  {value:>14}")
    spark.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
