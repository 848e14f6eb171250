"""A JAX notebook's cell run again: 2 local workers train the same model 3 times, from an empty user cache.

JAX workers keep their compiled programs in JAX's persistent compilation cache under the user's cache
directory (worker/runtime.py's ``use_jax_compilation_cache``): the first run compiles and stores them, a run
of the same cell loads them. ``python benchmarks/jax_rerun.py [--runs 3]`` points the user's cache directory
(XDG_CACHE_HOME) at a new temporary one, then prints each run's seconds (the call, and its first epoch, where
the steps compile) and the cache's entries after it. Run it on a tree without the cache for the "before".
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ["KERAS_BACKEND"] = "jax"
CACHE_HOME = tempfile.mkdtemp(prefix="nbdist-jax-rerun-")
os.environ["XDG_CACHE_HOME"] = CACHE_HOME  # before the workers' fork server starts: they inherit it

import keras  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import nbdist  # noqa: E402


def cell() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    x, y = load_digits(return_X_y=True)
    x, y = (x / 16).astype("float32"), y.astype("int64")
    rows = []
    for run in range(args.runs):
        started = time.perf_counter()
        job = nbdist.train(cell(), x, y, workers=2, epochs=args.epochs, batch_size=32, validation_split=0.2,
                           ui="none")
        seconds = time.perf_counter() - started
        entries = sum(1 for _ in Path(CACHE_HOME).rglob("*-cache"))
        rows.append({"run": run + 1, "seconds": round(seconds, 2), "first_epoch": round(job.state.epoch_seconds[0], 2),
                     "cache_entries": entries, "val_accuracy": round(float(job.history["val_accuracy"][-1]), 4)})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
