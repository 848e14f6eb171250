"""The torch device sum with its buckets started during the backward pass against at apply (issue 36), on the CPU.

2 workers on Keras' torch backend, ``--strategy allreduce``, the gradients summed as torch tensors over Gloo
(device_sum="always", the GPU's code): buckets overlapped with the backward pass (the default) and started
at apply (overlap=False), beside the CPU's default numpy exchange. ``python benchmarks/torch_overlap.py
[--epochs 3] [--rounds 2] [--bucket-mib 25]`` prints, per model, the mean epoch after the first in ms per step
for each, in alternating rounds, and the largest weight difference from the at-apply run;
``BENCH_MODELS=mlp_8.4M`` runs one model.
"""
from __future__ import annotations

import json
import os

os.environ["KERAS_BACKEND"] = "torch"

from two_worker_steps import alternating, arguments, weight_gap

MODELS = {"mlp_8.4M": (2048, [2048, 2048], 1024), "mlp_25M": (2048, [4096, 4096], 1024)}
ONLY = os.environ.get("BENCH_MODELS", "").split(",") if os.environ.get("BENCH_MODELS") else list(MODELS)
RUNS = {"numpy": {}, "at_apply": {"device_sum": "always", "overlap": False}, "overlapped": {"device_sum": "always"}}


def main() -> None:
    args = arguments(epochs=3)
    bucket = {"bucket_bytes": int(args.bucket_mib * 2**20)}
    out: dict[str, object] = {"bucket_mib": args.bucket_mib}
    for name in ONLY:
        configs = {label: {**options, **(bucket if options else {})} for label, options in RUNS.items()}
        runs = alternating(MODELS[name], configs, args, lr=1e-4)
        times = {label: [r["ms_per_step"] for r in rs] for label, rs in runs.items()}
        out[name] = {"ms_per_step": {k: [round(t, 1) for t in v] for k, v in times.items()},
                     "overlapped_over_at_apply": round(min(times["overlapped"]) / min(times["at_apply"]), 3),
                     "summed_by": {label: rs[-1]["summed_by"] for label, rs in runs.items()},
                     "weight_gap": {k: weight_gap(runs[k][-1]["weights"], runs["at_apply"][-1]["weights"])
                                    for k in ("numpy", "overlapped")}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
