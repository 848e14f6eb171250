"""TensorFlow's device sum against the numpy exchange on the CPU (issue 36): 2 workers on Keras' TensorFlow
backend, ``--strategy allreduce``, the gradients summed by the default numpy exchange (``tf.numpy_function``,
shared memory) or as tensors moved by DLPack into torch's bucketed sum over Gloo (device_sum="always", the
GPU's code with NCCL there). ``python benchmarks/tf_device_sum.py [--epochs 5] [--rounds 2]`` prints, per model,
the mean epoch after the first in ms per step and the time inside the sum per step (the workers' reports), in
alternating rounds, the largest weight difference between the two runs, and, in this process, what the bridge
alone costs per step: a ``tf.py_function`` handing the model's gradients to torch and back by DLPack against a
``tf.numpy_function`` handing them over as arrays, both summing nothing. ``BENCH_MODELS=digits_mlp`` runs one.
"""
from __future__ import annotations

import json
import os
import time

os.environ["KERAS_BACKEND"] = "tensorflow"

from two_worker_steps import alternating, arguments, build, weight_gap

MODELS = {"digits_mlp": (64, [32], 1536), "mlp_1.3M": (256, [1024, 1024], 4096)}
ONLY = os.environ.get("BENCH_MODELS", "").split(",") if os.environ.get("BENCH_MODELS") else list(MODELS)
RUNS = {"numpy": {}, "device": {"device_sum": "always"}}


def bridge(name: str, calls: int = 200) -> dict[str, float]:
    """ms per call of the two bridges on the model's gradient shapes, nothing summed."""
    import tensorflow as tf
    from torch.utils import dlpack as torch_dlpack

    shapes = [tuple(v.shape) for v in build(*MODELS[name][:2]).trainable_variables]
    grads = [tf.ones(s) for s in shapes]

    def through_torch(*tensors: tf.Tensor) -> list[tf.Tensor]:
        moved = [torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(t)) for t in tensors]
        return [tf.experimental.dlpack.from_dlpack(torch_dlpack.to_dlpack(t)) for t in moved]

    steps = {"py_function_dlpack": tf.function(lambda *g: tf.py_function(through_torch, g, [tf.float32] * len(g))),
             "numpy_function": tf.function(lambda *g: tf.numpy_function(lambda *a: list(a), g, [tf.float32] * len(g)))}
    out = {}
    for label, step in steps.items():
        step(*grads)
        t0 = time.perf_counter()
        for _ in range(calls):
            step(*grads)
        out[label] = round(1000 * (time.perf_counter() - t0) / calls, 3)
    return out


def main() -> None:
    args = arguments(epochs=5)
    out: dict[str, object] = {}
    for name in ONLY:
        runs = alternating(MODELS[name], RUNS, args)
        times = {label: [round(r["ms_per_step"], 2) for r in rs] for label, rs in runs.items()}
        out[name] = {"ms_per_step": times,
                     "sum_ms_per_step": {label: [round(r["sync_ms"], 3) for r in rs] for label, rs in runs.items()},
                     "summed_by": {label: rs[-1]["summed_by"] for label, rs in runs.items()},
                     "device_over_numpy": round(min(times["device"]) / min(times["numpy"]), 3),
                     "weight_gap": weight_gap(runs["numpy"][-1]["weights"], runs["device"][-1]["weights"]),
                     "bridge_ms_per_call": bridge(name)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
