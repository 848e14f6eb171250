"""Overhead of nbdist on one worker against plain ``model.fit``, and time to first metric.

Prints a table measured in one run:
- steady-state epoch time, 1 local worker / plain fit on the same model and data (goal <= 1.05);
- seconds from the call to the first per-epoch metric (goal <= 6 s).
Steady state = median epoch time over the epochs after the first (which pays for tracing).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(seed: int, width: int):
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(width, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def measure(epochs: int = 8, samples: int = 60_000, width: int = 256, repeats: int = 3) -> dict:
    """Per repeat: steady epoch ratio (1 worker / plain fit) and seconds from start to the first metric.

    Each repeat times plain fit and nbdist back to back, so its ratio compares runs made
    under the same machine load.
    """
    import keras
    import numpy as np

    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    rng = np.random.default_rng(0)
    x = rng.random((samples, 64), dtype=np.float32)
    y = rng.integers(0, 10, samples)
    out: dict[str, list[float]] = {"ratio": [], "plain_epoch": [], "dist_epoch": [], "first_metric": []}

    class Timer(keras.callbacks.Callback):
        """Appends each epoch's seconds after the first (which traces the graph) to ``sink``."""

        def __init__(self, sink: list[float]) -> None:
            super().__init__()
            self.sink = sink

        def on_epoch_begin(self, epoch, logs=None):
            self.t = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if epoch > 0:
                self.sink.append(time.perf_counter() - self.t)

    for _ in range(repeats):
        plain_epochs: list[float] = []
        build(0, width).fit(x, y, batch_size=64, epochs=epochs, verbose=0, callbacks=[Timer(plain_epochs)])
        job = prepare(build(0, width), TrainConfig(epochs=epochs, batch_size=64, workers=1, ui="none"),
                      x, y, None)
        job.start()
        job.wait()
        plain = statistics.median(plain_epochs)
        dist = statistics.median(job.state.epoch_seconds[1:])
        out["ratio"].append(dist / plain)
        out["plain_epoch"].append(plain)
        out["dist_epoch"].append(dist)
        out["first_metric"].append(job.state.first_metric_at or float("nan"))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--samples", type=int, default=60_000)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import nbdist

    m = measure(args.epochs, args.samples, args.width, args.repeats)
    plain = statistics.median(m["plain_epoch"])
    dist = statistics.median(m["dist_epoch"])
    first_metric = m["first_metric"]
    rows = [
        ("steady epoch, 1 worker / plain fit", f"{statistics.median(m['ratio']):.3f}", "<= 1.05",
         f"{dist * 1000:.0f} ms vs {plain * 1000:.0f} ms"),
        ("call to first epoch metric (s)", f"{statistics.median(first_metric):.2f}", "<= 6",
         f"min {min(first_metric):.2f}, max {max(first_metric):.2f}"),
    ]
    print(f"nbdist {nbdist.__version__} overhead: {args.samples} samples x 64, MLP {args.width}x2, "
          f"batch 64, {args.epochs} epochs, {args.repeats} repeats, {os.cpu_count()} cores")
    print(f"{'measure':<38} {'value':>8} {'goal':>8}  detail")
    for name, value, goal, detail in rows:
        print(f"{name:<38} {value:>8} {goal:>8}  {detail}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
