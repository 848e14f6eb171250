"""Spark data streamed into the workers (issue 24): their peak memory, and their speed against in-memory data.

The data is generated once as Parquet (64 float32 features in an array column and a 0/1 label)
under a cache directory and reused between runs. Read back with one Parquet file per Spark
partition (``spark.sql.files.maxPartitionBytes`` large), so each of the 2 tasks streams one file
and no shuffle runs before training.

    python benchmarks/stream_memory.py --gb 1.5 [--cache DIR]    # P9 memory at one size
    python benchmarks/stream_memory.py --speed --gb 0.2           # P9 speed
    python benchmarks/stream_memory.py --local --gb 2             # P9 local
    python benchmarks/stream_memory.py --rebalance --gb 1         # P9R: one file (rebalanced) vs two

Memory: each worker's RSS sampled every 0.1 s while it trains one epoch of a softmax regression
(the model is tiny, so the RSS above a worker's start is its data path). Speed: samples per second
of the last of 2 epochs of an MLP 256x2 (batch 256 per worker), streamed from the Spark tasks'
files against the same rows as numpy arrays on 2 local workers.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import psutil

FEATURES = 64
ROW_BYTES = (FEATURES + 1) * 4  # float32 features and label, as the workers hold them
DEFAULT_CACHE = Path(os.environ.get("NBDIST_BENCH_CACHE", Path.home() / ".cache" / "nbdist-bench"))


def start_spark(workers: int = 2) -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{workers}]").appName("nbdist-stream")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.pyspark.python", sys.executable).config("spark.driver.host", "127.0.0.1")
             .config("spark.driver.memory", "2g")
             .config("spark.sql.files.maxPartitionBytes", str(64 * 2**30))  # one partition per file
             .config("spark.sql.files.openCostInBytes", str(64 * 2**30))
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def parquet_data(spark: Any, gb: float, cache: Path = DEFAULT_CACHE, files: int = 2) -> tuple[str, int]:
    """The Parquet directory of ``gb`` GB of float32 rows (written once, then reused) and its rows."""
    from pyspark.sql import functions as F

    rows = int(gb * 1e9 / ROW_BYTES)
    path = cache / f"stream-{rows}-rows-{files}-files.parquet"
    if not (path / "_SUCCESS").exists():
        features = F.array(*[F.rand(seed=i).cast("float") for i in range(FEATURES)])
        df = (spark.range(0, rows, numPartitions=files).select(features.alias("features"))
              .withColumn("label", (F.aggregate("features", F.lit(0.0), lambda a, b: a + b) > FEATURES / 2)
                          .cast("int")))
        df.write.mode("overwrite").parquet(str(path))
    return str(path), rows


def _job_workers(job: Any) -> list[psutil.Process]:
    host, port = job._coordinator.address
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = p.info.get("cmdline") or []
        if "nbdist.worker" in cmd and f"{host}:{port}" in cmd and p.info.get("status") != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def train_sampling(model: Any, x: Any, y: Any = None, **options: Any) -> tuple[Any, dict[int, float]]:
    """``nbdist.train`` in the background while every worker's RSS is sampled: the job and peaks (bytes)."""
    import nbdist
    from nbdist.driver.run import TERMINAL

    # Every run starts its own workers (warm_workers=False): their RSS from 0.
    job = nbdist.train(model, x, y, background=True, warm_workers=False, **options)
    peaks: dict[int, float] = {}
    while job.status not in TERMINAL:
        for p in _job_workers(job):
            try:
                peaks[p.pid] = max(peaks.get(p.pid, 0), p.memory_info().rss)
            except psutil.Error:
                pass
        time.sleep(0.1)
    job.wait()
    return job, peaks


def softmax(features: int = FEATURES) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(2, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def mlp(features: int = FEATURES) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(256, activation="relu"),
                              keras.layers.Dense(256, activation="relu"), keras.layers.Dense(2, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def measure_memory(spark: Any, gb: float, cache: Path = DEFAULT_CACHE, batch_size: int = 1024) -> dict[str, Any]:
    """One epoch streamed from ``gb`` GB of Parquet on 2 workers: each worker's peak RSS against its share."""
    path, rows = parquet_data(spark, gb, cache)
    df = spark.read.parquet(path)
    t0 = time.perf_counter()
    job, peaks = train_sampling(softmax(), df, features="features", label="label", epochs=1,
                                batch_size=batch_size, workers=2, backend="spark", ui="none")
    shares = [w.samples * ROW_BYTES for w in job.state.workers]
    return {"gb": gb, "rows": rows, "share_mb": [s / 2**20 for s in shares],
            "peak_mb": sorted(p / 2**20 for p in peaks.values()), "seconds": time.perf_counter() - t0,
            "rows_trained": sum(w.samples for w in job.state.workers)}


def measure_rebalance(spark: Any, gb: float, cache: Path = DEFAULT_CACHE, batch_size: int = 1024) -> dict[str, Any]:
    """P9R: one epoch on 2 workers of ``gb`` GB written as two Parquet files (two partitions, read as they
    are) and as one file read as one partition (nbdist counts the rows and shuffles each worker its half):
    each worker's peak RSS, each run's seconds, and the run's note on the rebalancing."""
    out: dict[str, Any] = {"gb": gb}
    for name, files in (("balanced", 2), ("skewed", 1)):
        path, rows = parquet_data(spark, gb, cache, files=files)
        df = spark.read.parquet(path)
        t0 = time.perf_counter()
        job, peaks = train_sampling(softmax(), df, features="features", label="label", epochs=1,
                                    batch_size=batch_size, workers=2, backend="spark", ui="none")
        out[name] = {"rows": rows, "partitions": df.rdd.getNumPartitions(), "note": job.state.data_note,
                     "samples": [w.samples_done for w in job.state.workers],
                     "share_mb": [w.samples * ROW_BYTES / 2**20 for w in job.state.workers],
                     "peak_mb": sorted(p / 2**20 for p in peaks.values()), "seconds": time.perf_counter() - t0}
    out["ratio"] = max(out["skewed"]["peak_mb"]) / max(out["balanced"]["peak_mb"])
    return out


def measure_speed(spark: Any, gb: float, cache: Path = DEFAULT_CACHE, batch_size: int = 256) -> dict[str, Any]:
    """Samples/s of the steady (second) epoch: streamed from the Spark tasks' files vs numpy on local workers."""

    import nbdist

    path, rows = parquet_data(spark, gb, cache)
    df = spark.read.parquet(path)
    options = dict(epochs=2, batch_size=batch_size, workers=2, strategy="allreduce", ui="none")
    streamed = nbdist.train(mlp(), df, features="features", label="label", backend="spark", warm_workers=False,
                            **options)
    # The same rows in memory on the notebook's side, read from the Parquet files with pyarrow: a Spark
    # collect (toPandas) of 0.5 GB of array rows exhausts the 2 GB Spark driver and hangs there.
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    features = table.column("features").combine_chunks()
    X = features.flatten().to_numpy().astype("float32").reshape(len(table), FEATURES)
    y = table.column("label").to_numpy().astype("int64")
    del table, features
    in_memory = nbdist.train(mlp(), X, y, backend="local", warm_workers=False, **options)
    rate = lambda job: sum(w.samples for w in job.state.workers) / job.state.epoch_seconds[-1]
    return {"gb": gb, "rows": rows, "streamed_per_s": rate(streamed), "in_memory_per_s": rate(in_memory),
            "ratio": rate(streamed) / rate(in_memory)}


def npy_data(gb: float, cache: Path = DEFAULT_CACHE) -> tuple[Path, Path]:
    """``gb`` GB of float32 features as an .npy (written once, a block at a time) and its labels."""
    import numpy as np

    rows = int(gb * 1e9 / (FEATURES * 4))
    x_path, y_path = cache / f"local-{rows}-x.npy", cache / f"local-{rows}-y.npy"
    if not y_path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        out = np.lib.format.open_memmap(str(x_path) + ".tmp", mode="w+", dtype=np.float32, shape=(rows, FEATURES))
        rng = np.random.default_rng(0)
        for a in range(0, rows, 2**18):
            out[a:a + 2**18] = rng.random((min(2**18, rows - a), FEATURES), dtype=np.float32)
        out.flush()
        del out
        os.replace(str(x_path) + ".tmp", x_path)
        x = np.load(x_path, mmap_mode="r")
        y = np.concatenate([(x[a:a + 2**18].sum(axis=1) > FEATURES / 2) for a in range(0, rows, 2**18)])
        np.save(y_path, y.astype(np.int64))
    return x_path, y_path


def measure_local(gb: float, workers: int = 4, cache: Path = DEFAULT_CACHE) -> dict[str, Any]:
    """One epoch on ``workers`` local workers of a memory-mapped ``gb`` GB .npy: the workers' summed RSS
    (sampled) and the notebook's growth, against the same on an array 64 times smaller (TensorFlow's and
    the model's own memory), over the array's size."""
    import numpy as np

    me = psutil.Process()
    out: dict[str, Any] = {"gb": gb, "workers": workers}
    for name, size in (("small", gb / 64), ("big", gb)):
        x_path, y_path = npy_data(size, cache)
        x, y = np.load(x_path, mmap_mode="r"), np.load(y_path)
        before = me.memory_info().rss
        job, peaks, total = train_summing(softmax(), x, y, epochs=1, batch_size=1024, workers=workers,
                                          backend="local", ui="none")
        out[name] = {"array_mb": x.nbytes / 2**20, "workers_peak_sum_mb": total / 2**20,
                     "notebook_growth_mb": (me.memory_info().rss - before) / 2**20,
                     "rows_trained": sum(w.samples for w in job.state.workers)}
    data_mb = out["big"]["workers_peak_sum_mb"] - out["small"]["workers_peak_sum_mb"] \
        + max(0.0, out["big"]["notebook_growth_mb"])
    out["ratio"] = data_mb / out["big"]["array_mb"]
    return out


def train_summing(model: Any, x: Any, y: Any = None, **options: Any) -> tuple[Any, dict[int, float], float]:
    """``train_sampling``, also the peak of the workers' summed RSS."""
    import nbdist
    from nbdist.driver.run import TERMINAL

    job = nbdist.train(model, x, y, background=True, warm_workers=False, **options)  # RSS from 0, as above
    peaks: dict[int, float] = {}
    total = 0.0
    while job.status not in TERMINAL:
        now = 0.0
        for p in _job_workers(job):
            try:
                rss = p.memory_info().rss
            except psutil.Error:
                continue
            peaks[p.pid] = max(peaks.get(p.pid, 0), rss)
            now += rss
        total = max(total, now)
        time.sleep(0.1)
    job.wait()
    return job, peaks, total


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.5)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--speed", action="store_true", help="P9 speed instead of P9 memory")
    p.add_argument("--local", action="store_true", help="P9 local (4 local workers on a memory map)")
    p.add_argument("--rebalance", action="store_true", help="P9R: a one-partition DataFrame, rebalanced")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.local:
        print(json.dumps(measure_local(args.gb, cache=args.cache), indent=1))
        return 0
    spark = start_spark()
    try:
        measure = measure_speed if args.speed else measure_rebalance if args.rebalance else measure_memory
        m = measure(spark, args.gb, args.cache)
    finally:
        spark.stop()
    print(json.dumps(m, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
