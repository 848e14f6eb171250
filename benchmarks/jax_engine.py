"""JAX's engine against the host path on the CPU (issue 36): 2 workers on Keras' JAX backend, the gradients
summed through a host call over nbdist's exchange (the default) or by JAX's Gloo collectives inside the jitted
step (``--engine jax``). ``python benchmarks/jax_engine.py [--epochs 5]`` prints, per model, the mean epoch
after the first (ms per step) for each engine, in alternating rounds, and the largest weight difference
between the two runs.
"""
from __future__ import annotations

import json
import os

os.environ["KERAS_BACKEND"] = "jax"

from two_worker_steps import alternating, arguments, weight_gap

MODELS = {"digits_mlp": (64, [32], 1536), "mlp_1.3M": (256, [1024, 1024], 4096)}
ONLY = os.environ.get("BENCH_MODELS", "").split(",") if os.environ.get("BENCH_MODELS") else list(MODELS)


def main() -> None:
    args = arguments(epochs=5)
    out: dict[str, object] = {}
    for name in ONLY:
        runs = alternating(MODELS[name], {"host": {"engine": "gloo"}, "jax": {"engine": "jax"}}, args)
        times = {label: [r["ms_per_step"] for r in rs] for label, rs in runs.items()}
        out[name] = {"ms_per_step": {k: [round(t, 2) for t in v] for k, v in times.items()},
                     "jax_over_host": round(min(times["jax"]) / min(times["host"]), 3),
                     "weight_gap": weight_gap(runs["host"][-1]["weights"], runs["jax"][-1]["weights"])}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
