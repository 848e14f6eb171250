"""P3: nbdist averaging on Spark local[N] against Elephas 7.3 on the same Spark settings, model,
data and epochs, with plain Keras's accuracy beside them.

``--connect`` runs nbdist's side over Spark Connect (``SparkSession.builder.remote("local[N]")``,
the notebook 02b session) on a DataFrame, as a Connect notebook must: Connect has no SparkContext
and no RDDs, so Elephas cannot run there at all and its figure stays the classic session's.

Elephas needs TensorFlow < 2.20 and numpy < 2, so it lives in its own virtual environment
(``ELEPHAS_VENV``), created here from PyPI on first use; its side runs as a subprocess of that
venv's Python (benchmarks/elephas_digits.py). Nothing of Elephas is vendored.

    PYTHONPATH=. python benchmarks/elephas_compare.py [--install] [--repeats 3] [--connect]
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
PAUSE = 10.0  # seconds between a session's first run and its second, as between two notebook cells


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


def run_elephas(data: Path, epochs: int = EPOCHS, workers: int = 2, seed: int = 0, pause: float = PAUSE,
                timeout: float = 900.0) -> dict:
    """One Elephas session in its own venv's process: a cold fit, then a warm one ``pause`` s later."""
    out = subprocess.run([str(elephas_python()), str(HERE / "elephas_digits.py"), str(data), "--epochs",
                          str(epochs), "--workers", str(workers), "--batch-size", str(BATCH), "--seed", str(seed),
                          "--pause", str(pause)],
                         capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ""})
    if out.returncode != 0:
        raise RuntimeError(f"Elephas run failed: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_nbdist_session(data: Path, epochs: int = EPOCHS, workers: int = 2, seed: int = 0, pause: float = PAUSE,
                       connect: bool = False, timeout: float = 900.0) -> dict:
    """One nbdist session in a process of its own, as Elephas's: the first run after the SparkSession
    starts (cold: its tasks' workers import TensorFlow), then a second one ``pause`` s later (warm:
    the executors' warm workers). A new process per repeat, so no repeat finds an earlier one's
    warm workers."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--session", str(data), "--epochs", str(epochs),
           "--workers", str(workers), "--seed", str(seed), "--pause", str(pause)] + (["--connect"] if connect else [])
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}  # its runs keep warm workers (the default), as a user's
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"nbdist run failed: {out.stderr.strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def session(data: Path, epochs: int, workers: int, seed: int, pause: float, connect: bool) -> dict:
    spark = start_spark(workers, connect)
    try:
        cold = run_nbdist(spark, data, epochs, workers, seed, connect)
        time.sleep(pause)
        warm = run_nbdist(spark, data, epochs, workers, seed, connect)
    finally:
        spark.stop()
    return {"seconds": cold["seconds"], "warm_seconds": warm["seconds"], "accuracy": cold["accuracy"]}


def start_spark(workers: int, connect: bool = False):
    """A classic local[N] session, or a Spark Connect client to a local[N] Connect server."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName("nbdist-vs-elephas")
    builder = builder.remote(f"local[{workers}]") if connect else builder.master(f"local[{workers}]")
    spark = (builder.config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.pyspark.python", sys.executable).config("spark.driver.host", "127.0.0.1")
             .getOrCreate())
    if not connect:
        spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_nbdist(spark, data: Path, epochs: int = EPOCHS, workers: int = 2, seed: int = 0,
               connect: bool = False) -> dict:
    """nbdist averaging on the RDD of (x, y) pairs Elephas gets (over Connect: a DataFrame of the
    same rows, built before the clock starts); the train call timed like Elephas's fit."""
    import nbdist

    d = np.load(data)
    rows = list(zip(d["x_train"].tolist(), d["y_train"].tolist()))
    if connect:
        data_arg = spark.createDataFrame(rows, ["features", "label"]).repartition(workers)
        columns = {"features": "features", "label": "label"}
    else:
        data_arg, columns = spark.sparkContext.parallelize(rows, workers), {}
    model = mlp(seed)
    t0 = time.perf_counter()
    nbdist.train(model, data_arg, epochs=epochs, batch_size=BATCH, workers=workers, backend="spark",
                 strategy="averaging", seed=seed, **columns)
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
            elephas_repeats: int | None = None, install: bool = False, connect: bool = False,
            pause: float = PAUSE) -> dict:
    """Per-repeat wall times and accuracies of nbdist, Elephas (when its venv is ready) and Keras.

    Repeat i seeds all three with i (initial weights and shuffling), so the accuracies compared
    are medians over seeds: one seed's 450 test images move by a point on 5 images. Each repeat is
    a new session in a new process for nbdist and Elephas alike, timing its first run (cold) and a
    second run ``PAUSE`` s later (warm). ``connect``: nbdist runs over Spark Connect.
    """
    data = write_digits(workdir / "digits_split.npz")
    reason = elephas_ready()
    if reason and install:
        reason = install_elephas()
    out: dict = {"nbdist": [], "elephas": [], "keras": [], "elephas_skipped": reason, "epochs": epochs,
                 "workers": workers, "connect": connect, "pause": pause}
    for seed in range(elephas_repeats if elephas_repeats is not None else repeats):
        if reason is None:
            out["elephas"].append(run_elephas(data, epochs, workers, seed, pause))
    for seed in range(repeats):
        out["nbdist"].append(run_nbdist_session(data, epochs, workers, seed, pause, connect))
    for seed in range(repeats):
        out["keras"].append(run_keras(data, epochs, seed))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--install", action="store_true", help="create Elephas's venv from PyPI when missing")
    p.add_argument("--connect", action="store_true", help="nbdist over Spark Connect (Elephas stays classic)")
    p.add_argument("--session", type=Path, default=None, help=argparse.SUPPRESS)  # one nbdist session (a child)
    p.add_argument("--workers", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--pause", type=float, default=PAUSE, help=argparse.SUPPRESS)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.session:
        print(json.dumps(session(args.session, args.epochs, args.workers, args.seed, args.pause, args.connect)))
        return 0
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        m = measure(Path(tmp), args.repeats, args.epochs, install=args.install, connect=args.connect)
    for name in ("nbdist", "elephas", "keras"):
        runs = m[name]
        if runs:
            warm = [r["warm_seconds"] for r in runs if r.get("warm_seconds") is not None]
            cold = statistics.median(r["seconds"] for r in runs)
            accuracy = statistics.median(r["accuracy"] for r in runs)
            print(f"{name:<8} {cold:7.2f} s" + (f" cold, {statistics.median(warm):.2f} s warm" if warm else "")
                  + f"  accuracy {accuracy:.3f}  ({len(runs)} runs)")
    if m["elephas_skipped"]:
        print(f"Elephas skipped: {m['elephas_skipped']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
