"""P3: nbdist averaging on Spark local[N] against Elephas 7.3 on the same Spark settings, model,
data and epochs, with plain Keras's accuracy beside them.

Elephas needs TensorFlow < 2.20 and numpy < 2, so it lives in its own virtual environment
(``ELEPHAS_VENV``), created here from PyPI on first use; its side runs as a subprocess of that
venv's Python (benchmarks/elephas_digits.py). Nothing of Elephas is vendored.

    PYTHONPATH=. python benchmarks/elephas_compare.py [--install] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
ELEPHAS_VENV = Path(os.environ.get("NBDIST_ELEPHAS_VENV", Path.home() / ".cache" / "nbdist-bench" / "elephas-venv"))
# The set that installed and trained here (Python 3.11, Java 17, 2026-11): elephas 7.3.0 declares
# tensorflow<2.20, numpy<2, pyspark<=4.0.0; TF 2.19.1 is the newest it accepts and brings Keras 3.15.
ELEPHAS_PINS = ["elephas==7.3.0", "tensorflow==2.19.1", "keras==3.15.1", "numpy==1.26.4", "pyspark==4.0.0"]
INSTALL_TIMEOUT = 1800.0
EPOCHS = 15
BATCH = 32


def elephas_python() -> Path:
    return ELEPHAS_VENV / "bin" / "python"


def elephas_ready() -> str | None:
    """None when Elephas imports in its venv; otherwise why not."""
    py = elephas_python()
    if not py.exists():
        return f"no Elephas venv at {ELEPHAS_VENV}"
    try:
        subprocess.run([str(py), "-c", "import elephas.spark_model"], check=True, capture_output=True,
                       timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        return f"Elephas does not import in {ELEPHAS_VENV}: {exc}"
    return None


def install_elephas() -> str | None:
    """Create the venv and pip-install the pins from PyPI; None on success, else the reason."""
    ELEPHAS_VENV.parent.mkdir(parents=True, exist_ok=True)
    try:
        if not elephas_python().exists():
            subprocess.run([sys.executable, "-m", "venv", str(ELEPHAS_VENV)], check=True, timeout=300,
                           capture_output=True)
        log.warning("installing %s into %s (several minutes, from PyPI)", " ".join(ELEPHAS_PINS), ELEPHAS_VENV)
        subprocess.run([str(elephas_python()), "-m", "pip", "install", "--quiet", *ELEPHAS_PINS], check=True,
                       timeout=INSTALL_TIMEOUT, capture_output=True, text=True)
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or "").strip().splitlines()[-1:] or [str(exc)]
        return f"pip could not install Elephas ({tail[0][:200]})"
    except subprocess.TimeoutExpired:
        return f"installing Elephas took over {INSTALL_TIMEOUT:.0f} s"
    return elephas_ready()


def write_digits(path: Path) -> Path:
    """The same train/test split for every contestant, as one .npz."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16).astype("float32")
    xtr, xte, ytr, yte = train_test_split(x, y.astype("int64"), test_size=0.25, random_state=0)
    np.savez(path, x_train=xtr, y_train=ytr, x_test=xte, y_test=yte)
    return path


def mlp(seed: int = 0):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def run_elephas(data: Path, epochs: int = EPOCHS, workers: int = 2, seed: int = 0, timeout: float = 900.0) -> dict:
    out = subprocess.run([str(elephas_python()), str(HERE / "elephas_digits.py"), str(data), "--epochs",
                          str(epochs), "--workers", str(workers), "--batch-size", str(BATCH), "--seed", str(seed)],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ""})
    if out.returncode != 0:
        raise RuntimeError(f"Elephas run failed: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def start_spark(workers: int):
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(f"local[{workers}]").appName("nbdist-vs-elephas")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.pyspark.python", sys.executable).config("spark.driver.host", "127.0.0.1")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_nbdist(spark, data: Path, epochs: int = EPOCHS, workers: int = 2, seed: int = 0) -> dict:
    """nbdist averaging on the RDD of (x, y) pairs Elephas gets; the train call timed like Elephas's fit."""
    import nbdist

    d = np.load(data)
    rdd = spark.sparkContext.parallelize(list(zip(d["x_train"].tolist(), d["y_train"].tolist())), workers)
    model = mlp(seed)
    t0 = time.perf_counter()
    nbdist.train(model, rdd, epochs=epochs, batch_size=BATCH, workers=workers, backend="spark",
                 strategy="averaging", seed=seed)
    seconds = time.perf_counter() - t0
    _, accuracy = model.evaluate(d["x_test"], d["y_test"], verbose=0)
    return {"seconds": seconds, "accuracy": float(accuracy)}


def run_keras(data: Path, epochs: int = EPOCHS, seed: int = 0) -> dict:
    d = np.load(data)
    model = mlp(seed)
    t0 = time.perf_counter()
    model.fit(d["x_train"], d["y_train"], batch_size=BATCH, epochs=epochs, verbose=0)
    seconds = time.perf_counter() - t0
    _, accuracy = model.evaluate(d["x_test"], d["y_test"], verbose=0)
    return {"seconds": seconds, "accuracy": float(accuracy)}


def measure(workdir: Path, repeats: int = 3, epochs: int = EPOCHS, workers: int = 2,
            elephas_repeats: int | None = None, install: bool = False) -> dict:
    """Per-repeat wall times and accuracies of nbdist, Elephas (when its venv is ready) and Keras.

    Repeat i seeds all three with i (initial weights and shuffling), so the accuracies compared
    are medians over seeds: one seed's 450 test images move by a point on 5 images.
    """
    data = write_digits(workdir / "digits_split.npz")
    reason = elephas_ready()
    if reason and install:
        reason = install_elephas()
    out: dict = {"nbdist": [], "elephas": [], "keras": [], "elephas_skipped": reason, "epochs": epochs,
                 "workers": workers}
    for seed in range(elephas_repeats if elephas_repeats is not None else repeats):
        if reason is None:
            out["elephas"].append(run_elephas(data, epochs, workers, seed))
    spark = start_spark(workers)
    try:
        for seed in range(repeats):
            out["nbdist"].append(run_nbdist(spark, data, epochs, workers, seed))
    finally:
        spark.stop()
    for seed in range(repeats):
        out["keras"].append(run_keras(data, epochs, seed))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--install", action="store_true", help="create Elephas's venv from PyPI when missing")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        m = measure(Path(tmp), args.repeats, args.epochs, install=args.install)
    for name in ("nbdist", "elephas", "keras"):
        runs = m[name]
        if runs:
            print(f"{name:<8} {statistics.median(r['seconds'] for r in runs):7.2f} s  "
                  f"accuracy {statistics.median(r['accuracy'] for r in runs):.3f}  ({len(runs)} runs)")
    if m["elephas_skipped"]:
        print(f"Elephas skipped: {m['elephas_skipped']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
