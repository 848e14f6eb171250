"""P10 and P10c: a model of real size (an MLP 2048-4096-4096-10, 25.2M parameters, Adam) on 2 local workers.

Plain ``model.fit(batch_size=64)`` in this process against ``nbdist`` with 2 workers of batch 32
(the same global batch), both strategies, on 2048 random rows. Every run times its epochs from one
epoch's end to the next (for nbdist: when the driver holds the merged metrics), and the whole call.
P10 is the steady epoch (median of epochs 3-5) ÷ plain fit's, the worse strategy; P10c the whole
5-epoch call with warm workers (a fork server already up, as after ``%load_ext nbdist``) ÷ plain
fit's call. ``--quick`` runs an MLP 512-1024-1024-10 (1.6M parameters) on 512 rows for 3 epochs.
``--backend spark``: the workers are Spark ``local[2]`` tasks whose executors already hold warm
workers (a first small run made them), as on a notebook's second run: P10S.

``--cnn``: MobileNetV2 (3.5M parameters, 10 classes, 96x96 images, no pretrained weights) as a notebook
cell would train it: ``model.fit(batch_size=64)`` against 2 warm local workers of batch 32, the whole
call of 3 epochs each (P10M; ``--quick``: 32x32 images, width 0.35, 128 rows, 2 epochs).

    PYTHONPATH=. python benchmarks/big_model.py [--quick] [--repeats 2] [--backend spark] [--cnn]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SKIP = 2  # epochs left out of the steady median (tracing, warm-up)
SPARK_WARM_WAIT = 20.0  # s: a Spark task's next warm worker imports TensorFlow after the task's job ends
STRATEGIES = ("averaging", "allreduce")


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"features": 512, "hidden": 1024, "rows": 512, "epochs": 3}
    return {"features": 2048, "hidden": 4096, "rows": 2048, "epochs": 5}


def build(features: int, hidden: int) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((features,)), keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(hidden, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.Adam(1e-4), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def data(features: int, rows: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.random((rows, features), dtype=np.float32), rng.integers(0, 10, rows)


def steady(ends: list[float]) -> float:
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(gaps[SKIP:] if len(gaps) > SKIP else gaps)


def plain(size: dict[str, Any]) -> dict[str, float]:
    from epoch_breakdown import epoch_ends

    x, y = data(size["features"], size["rows"])
    model = build(size["features"], size["hidden"])
    ends: list[float] = []
    t0 = time.perf_counter()
    model.fit(x, y, batch_size=64, epochs=size["epochs"], verbose=0, callbacks=[epoch_ends(ends)])
    return {"epoch": steady(ends), "call": time.perf_counter() - t0}


def distributed(size: dict[str, Any], strategy: str, backend: str = "local") -> dict[str, float]:
    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    x, y = data(size["features"], size["rows"])
    model = build(size["features"], size["hidden"])
    cfg = TrainConfig(epochs=size["epochs"], batch_size=32, workers=2, strategy=strategy, backend=backend,
                      ui="none", seed=0)
    ends: list[float] = []

    def listener(kind: str, state: Any, payload: Any) -> None:
        if kind == "epoch":
            ends.append(time.perf_counter())

    t0 = time.perf_counter()
    job = prepare(model, cfg, x, y, None, listeners=[listener])
    ends.append(time.perf_counter())
    job.start()
    job.wait()
    call = time.perf_counter() - t0
    reports = [r for r in job.reports.values() if isinstance(r, dict)]
    return {"epoch": steady(ends), "call": call, "hosts": sorted(w.host for w in job.state.workers),
            "sync_s": [r.get("sync_seconds") for r in reports], "summed_by": [r.get("summed_by") for r in reports]}


def warm_up(backend: str = "local") -> None:
    """Start the fork server (or the executors' warm workers) and let it import, and run Keras once here,
    as a notebook has."""
    from first_metric import wait_warm

    import nbdist
    from nbdist.backends.warm import POOL

    small = {"features": 16, "hidden": 16, "rows": 128, "epochs": 1}
    x, y = data(16, 128)
    for _ in range(2 if backend == "spark" else 1):  # the first Spark run leaves the executors' workers warm
        nbdist.train(build(16, 16), x, y, epochs=1, workers=2, batch_size=32, backend=backend, ui="none")
    plain(small)
    if backend == "local":
        wait_warm(POOL)


def start_spark() -> Any:
    """Spark ``local[2]``, its executors running this Python, warm workers allowed."""
    from pyspark.sql import SparkSession

    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2]").appName("nbdist-big-model")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def measure(quick: bool = False, repeats: int = 2, backend: str = "local") -> dict[str, Any]:
    size = sizes(quick)
    spark = start_spark() if backend == "spark" else None
    try:
        warm_up(backend)
        out: dict[str, Any] = {"size": size, "backend": backend, "plain": [], **{s: [] for s in STRATEGIES}}
        for _ in range(repeats):  # each repeat back to back: its ratios compare runs under the same load
            out["plain"].append(plain(size))
            for strategy in STRATEGIES:
                if backend == "spark":  # the workers the last run's tasks left finish importing, as between cells
                    time.sleep(SPARK_WARM_WAIT)
                out[strategy].append(distributed(size, strategy, backend))
    finally:
        if spark is not None:
            spark.stop()
    for s in STRATEGIES:
        out[f"{s}_epoch_ratio"] = [d["epoch"] / p["epoch"] for d, p in zip(out[s], out["plain"])]
        out[f"{s}_call_ratio"] = [d["call"] / p["call"] for d, p in zip(out[s], out["plain"])]
    return out


def cnn_size(quick: bool) -> dict[str, Any]:
    if quick:
        return {"side": 32, "alpha": 0.35, "rows": 128, "epochs": 2}
    return {"side": 96, "alpha": 1.0, "rows": 1024, "epochs": 3}


def cnn(side: int, alpha: float) -> Any:
    import keras

    keras.utils.set_random_seed(0)
    model = keras.applications.MobileNetV2(input_shape=(side, side, 3), alpha=alpha, weights=None, classes=10)
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def cnn_cell(size: dict[str, Any], workers: int) -> float:
    """The whole call of a MobileNetV2 cell: plain ``fit`` at batch 64 (workers=0), or nbdist's 32 per worker."""
    import numpy as np

    import nbdist

    rng = np.random.default_rng(0)
    x = rng.random((size["rows"], size["side"], size["side"], 3), dtype=np.float32)
    y = rng.integers(0, 10, size["rows"])
    model = cnn(size["side"], size["alpha"])
    t0 = time.perf_counter()
    if workers:
        nbdist.train(model, x, y, epochs=size["epochs"], batch_size=64 // workers, workers=workers,
                     backend="local", ui="none", seed=0)
    else:
        model.fit(x, y, batch_size=64, epochs=size["epochs"], verbose=0)
    return time.perf_counter() - t0


def measure_cnn(quick: bool = False, repeats: int = 2) -> dict[str, Any]:
    size = cnn_size(quick)
    warm_up()
    out: dict[str, Any] = {"size": size, "plain": [], "nbdist": []}
    for _ in range(repeats):
        out["plain"].append(cnn_cell(size, 0))
        out["nbdist"].append(cnn_cell(size, 2))
    out["ratio"] = [d / p for d, p in zip(out["nbdist"], out["plain"])]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--backend", choices=("local", "spark", "containers"), default="local")
    p.add_argument("--cnn", action="store_true", help="the MobileNetV2 cell (P10M)")
    args = p.parse_args()
    if args.cnn:
        c = measure_cnn(args.quick, args.repeats)
        med = statistics.median
        print(f"MobileNetV2 cell: plain {med(c['plain']):.1f} s, 2 workers {med(c['nbdist']):.1f} s "
              f"({med(c['ratio']):.2f}x)")
        return 0
    m = measure(args.quick, args.repeats, args.backend)
    med = statistics.median
    print(f"plain fit: steady epoch {med(r['epoch'] for r in m['plain']):.2f} s, "
          f"call {med(r['call'] for r in m['plain']):.1f} s")
    for s in STRATEGIES:
        print(f"{s}: steady epoch {med(r['epoch'] for r in m[s]):.2f} s ({med(m[f'{s}_epoch_ratio']):.2f}x), "
              f"call {med(r['call'] for r in m[s]):.1f} s ({med(m[f'{s}_call_ratio']):.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
