"""The torch device sum with its buckets started during the backward pass against at apply (issue 36), on the CPU.

2 workers on Keras' torch backend, ``--strategy allreduce``, the gradients summed as torch tensors over Gloo
(NBDIST_TORCH_DEVICE_SUM=1, the GPU's code): buckets overlapped with the backward pass (the default) and started
at apply (NBDIST_TORCH_OVERLAP=0), beside the CPU's default numpy exchange. ``python benchmarks/torch_overlap.py
[--epochs 3] [--rounds 2]`` prints, per model, the mean epoch after the first in ms per step for each, in
alternating rounds, and the largest weight difference from the at-apply run. ``NBDIST_TORCH_BUCKET_BYTES``
(default 25 MiB) sets the buckets; ``BENCH_MODELS=mlp_8.4M`` runs one model.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ["KERAS_BACKEND"] = "torch"

import numpy as np
from two_worker_steps import build, two_workers

MODELS = {"mlp_8.4M": (2048, [2048, 2048], 1024), "mlp_25M": (2048, [4096, 4096], 1024)}
ONLY = os.environ.get("BENCH_MODELS", "").split(",") if os.environ.get("BENCH_MODELS") else list(MODELS)
RUNS = {"numpy": {}, "at_apply": {"NBDIST_TORCH_DEVICE_SUM": "1", "NBDIST_TORCH_OVERLAP": "0"},
        "overlapped": {"NBDIST_TORCH_DEVICE_SUM": "1"}}


def run(name: str, env: dict[str, str], epochs: int, batch: int) -> tuple[float, list[np.ndarray], list[str]]:
    dim, hidden, rows = MODELS[name]
    got = two_workers(build(dim, hidden, lr=1e-4), rows, epochs, batch, env)
    return got["ms_per_step"], got["weights"], got["summed_by"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="rows per worker per step")
    args = parser.parse_args()
    out: dict[str, object] = {"bucket_bytes": os.environ.get("NBDIST_TORCH_BUCKET_BYTES", "25 MiB")}
    for name in ONLY:
        times: dict[str, list[float]] = {label: [] for label in RUNS}
        weights: dict[str, list[np.ndarray]] = {}
        summed: dict[str, list[str]] = {}
        for _ in range(args.rounds):
            for label, env in RUNS.items():
                ms, weights[label], summed[label] = run(name, env, args.epochs, args.batch)
                times[label].append(ms)
        out[name] = {"ms_per_step": {k: [round(t, 1) for t in v] for k, v in times.items()},
                     "overlapped_over_at_apply": round(min(times["overlapped"]) / min(times["at_apply"]), 3),
                     "summed_by": summed,
                     "weight_gap": {k: float(max(np.abs(a - b).max() for a, b in zip(weights[k], weights["at_apply"])))
                                    for k in ("numpy", "overlapped")}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
