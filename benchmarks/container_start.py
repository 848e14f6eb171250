"""Container start latency: what --backend containers adds over local worker processes.

Prints one table measured in one run: a bare interpreter start on the host vs in a
container of the default image, and the time from launch until both workers of a
2-worker run have connected (TensorFlow import included), local vs containers.
Run: PYTHONPATH=. python benchmarks/container_start.py [--repeat 5]
"""
from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import time

import numpy as np

from nbdist.api import prepare
from nbdist.backends.containers import ensure_base_image, environment_mounts, find_engine
from nbdist.config import TrainConfig


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    return time.perf_counter() - t0


def time_to_connected(backend: str, x: np.ndarray, y: np.ndarray) -> float:
    import keras

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    job = prepare(model, TrainConfig(epochs=50, workers=2, backend=backend, ui="none"), x, y, None)
    t0 = time.perf_counter()
    job.start()
    try:
        while sum(1 for w in job.state.workers if w.host) < 2:
            job.pump(0.05)
            if time.perf_counter() - t0 > 300:
                raise TimeoutError("workers did not connect within 300 s")
        return time.perf_counter() - t0
    finally:
        job.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine = find_engine()
    image = ensure_base_image(engine)
    vols = [a for m in environment_mounts() for a in ("--volume", f"{m}:{m}:ro")]
    host_cmd = [sys.executable, "-c", "pass"]
    ctr_cmd = [engine.path, "run", "--rm", "--network", "host", *vols, image, sys.executable, "-c", "pass"]
    host = statistics.median(timed(host_cmd) for _ in range(args.repeat))
    ctr = statistics.median(timed(ctr_cmd) for _ in range(args.repeat))
    rng = np.random.default_rng(0)
    x, y = rng.random((512, 64), dtype=np.float32), rng.integers(0, 10, 512)
    local_conn = time_to_connected("local", x, y)
    ctr_conn = time_to_connected("containers", x, y)
    print(f"engine: {engine.name} ({engine.path}), image {image}, median of {args.repeat} for the bare starts")
    print(f"{'measure':<44}{'local (s)':>11}{'containers (s)':>16}{'ratio':>8}")
    print(f"{'python -c pass':<44}{host:>11.3f}{ctr:>16.3f}{ctr / host:>8.2f}")
    print(f"{'launch -> 2 workers connected (pre-TF)':<44}{local_conn:>11.3f}{ctr_conn:>16.3f}"
          f"{ctr_conn / local_conn:>8.2f}")
    print(f"container overhead per start: {ctr - host:.3f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
