"""JAX's engine against the host path on the CPU (issue 36): 2 workers on Keras' JAX backend, the gradients
summed through a host call over nbdist's exchange (the default) or by JAX's Gloo collectives inside the jitted
step (``--engine jax``). ``python benchmarks/jax_engine.py [--epochs 5]`` prints, per model, the mean epoch
after the first (ms per step) for each engine, in alternating rounds, and the largest weight difference
between the two runs.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ["KERAS_BACKEND"] = "jax"

import numpy as np
from two_worker_steps import build, two_workers

MODELS = {"digits_mlp": (64, [32], 1536), "mlp_1.3M": (256, [1024, 1024], 4096)}
ONLY = os.environ.get("BENCH_MODELS", "").split(",") if os.environ.get("BENCH_MODELS") else list(MODELS)


def run(name: str, engine: str | None, epochs: int, batch: int) -> tuple[float, list[np.ndarray]]:
    dim, hidden, rows = MODELS[name]
    got = two_workers(build(dim, hidden), rows, epochs, batch, engine=engine or "gloo")
    return got["ms_per_step"], got["weights"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="rows per worker per step")
    args = parser.parse_args()
    out: dict[str, object] = {}
    for name in ONLY:
        times: dict[str, list[float]] = {"host": [], "jax": []}
        weights: dict[str, list[np.ndarray]] = {}
        for _ in range(args.rounds):
            for label, engine in (("host", None), ("jax", "jax")):
                ms, weights[label] = run(name, engine, args.epochs, args.batch)
                times[label].append(ms)
        out[name] = {"ms_per_step": {k: [round(t, 2) for t in v] for k, v in times.items()},
                     "jax_over_host": round(min(times["jax"]) / min(times["host"]), 3),
                     "weight_gap": float(max(np.abs(a - b).max() for a, b in zip(weights["host"], weights["jax"])))}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
