"""The end of a tracked run: saving the trained Keras model for MLflow (``ui/tracking.py``'s
``_log_keras_model``) with the pip requirements nbdist gives (Keras and the backend at their installed
versions) against MLflow inferring them (it loads the model again in a child process), alternating.

Prints each way's median seconds over the rounds and their ratio (given / inferred).

    PYTHONPATH=. python benchmarks/mlflow_model.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    rounds = parser.parse_args().rounds
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import mlflow.keras

    from nbdist.ui.tracking import model_requirements

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    seconds: dict[str, list[float]] = {"inferred": [], "given": []}
    for _ in range(rounds):
        for way in ("inferred", "given"):
            with tempfile.TemporaryDirectory() as tmp:
                start = time.perf_counter()
                if way == "given":
                    mlflow.keras.save_model(model, os.path.join(tmp, "model"),
                                            pip_requirements=model_requirements(keras.config.backend()))
                else:
                    mlflow.keras.save_model(model, os.path.join(tmp, "model"))
                seconds[way].append(time.perf_counter() - start)
    inferred, given = (statistics.median(seconds[w]) for w in ("inferred", "given"))
    print(f"save_model, requirements inferred: {inferred:.2f} s; given: {given:.2f} s; "
          f"ratio {given / inferred:.3f} (median of {rounds})")


if __name__ == "__main__":
    main()
