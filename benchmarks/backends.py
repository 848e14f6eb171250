"""Keras backends side by side (issue 25): a worker's import cost and a training step, per backend.

``python benchmarks/backends.py [--epochs 6]`` prints, for TensorFlow, JAX and torch:
- the CPU seconds of what a worker imports before its job (``worker/main.py _import_for_training``,
  what a warm worker does ahead of time; a JAX or torch worker does not import TensorFlow);
- the wall seconds of a cold ``nbdist.train`` of the digits MLP (2 local workers, no warm workers);
- milliseconds per step: plain local ``fit`` (750 rows, batch 32) and, after the first epoch, each of 2
  workers (allreduce; averaging every 5 steps) on 1,500 digits rows, 32 rows per worker per step.
Each backend runs in its own process: Keras reads KERAS_BACKEND once.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

BACKENDS = ("tensorflow", "jax", "torch")


def import_cost(backend: str) -> float:
    code = ("import resource; from nbdist.worker.main import _import_for_training; _import_for_training(); "
            "u = resource.getrusage(resource.RUSAGE_SELF); print(u.ru_utime + u.ru_stime)")
    env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def training(epochs: int) -> dict[str, float]:
    import keras
    from sklearn.datasets import load_digits

    import nbdist

    x, y = load_digits(return_X_y=True)
    x = (x[:1500] / 16).astype("float32")
    y = y[:1500]
    out: dict[str, float] = {}
    steps = -(-750 // 32)
    keras.utils.set_random_seed(0)
    local = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    local.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    local.fit(x[:750], y[:750], batch_size=32, epochs=1, verbose=0)  # compiled and warmed up
    t0 = time.perf_counter()
    local.fit(x[:750], y[:750], batch_size=32, epochs=3, verbose=0)
    out["local_ms_per_step"] = 1000 * (time.perf_counter() - t0) / (3 * steps)
    for strategy in ("allreduce", "averaging"):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
        t0 = time.perf_counter()
        job = nbdist.train(model, x, y, epochs=epochs, batch_size=32, workers=2, strategy=strategy, ui="none",
                           averaging_frequency=5, warm_workers=False)  # cold runs: the import is the cost
        out[f"{strategy}_total_s"] = time.perf_counter() - t0
        seconds = job.state.epoch_seconds[1:]
        out[f"{strategy}_epoch_s"] = sum(seconds) / len(seconds)
        out[f"{strategy}_ms_per_step"] = 1000 * out[f"{strategy}_epoch_s"] / steps
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(training(args.epochs)), flush=True)
        return
    rows = []
    for backend in BACKENDS:
        env = {**os.environ, "KERAS_BACKEND": backend, "TF_CPP_MIN_LOG_LEVEL": "3"}
        done = subprocess.run([sys.executable, __file__, "--child", backend, "--epochs", str(args.epochs)], env=env,
                              capture_output=True, text=True, check=True)
        result = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
        rows.append((backend, import_cost(backend), result))
    print(f"{'backend':<11} {'import cpu s':>12} {'cold run s':>10} {'local fit ms/step':>18} "
          f"{'allreduce ms/step':>18} {'averaging ms/step':>18}")
    for backend, cost, r in rows:
        print(f"{backend:<11} {cost:12.2f} {r['allreduce_total_s']:10.1f} {r['local_ms_per_step']:18.2f} "
              f"{r['allreduce_ms_per_step']:18.2f} {r['averaging_ms_per_step']:18.2f}")


if __name__ == "__main__":
    main()
