"""TensorFlow's gradients summed where they are: handed to torch by DLPack (no copy) and summed by the torch
device sum (``device_sum.TorchDeviceSum``: buckets of 25 MiB on the gradients' device, each all-reduced as
soon as it is filled), then handed back to TensorFlow by DLPack (no copy).

On GPUs (engine ``nccl``, every worker with a GPU of its own) the buckets are CUDA tensors summed by NCCL;
``NBDIST_TF_DEVICE_SUM=1`` runs the very same code on CPU tensors over a Gloo group, which is how the tests
run it. On CPUs the numpy exchange stays the default (allreduce_hook.py): it is faster there.

The sum runs inside Keras' compiled train step as one ``tf.py_function`` (TensorFlow's own collectives
would need TensorFlow's cluster set-up; this reuses nbdist's store and torch's NCCL). Its GPU kernel calls
Python with the gradients still on the GPU, and takes back the tensors it returns as they are.

Streams (what this relies on; NOT RUN ON A GPU: no TensorFlow on the GPU machines). TensorFlow and torch
each queue their GPU work on streams of their own, in the one CUDA context of the process, and a DLPack
capsule carries no stream. So:

- before the first bucket is filled, one ``torch.cuda.synchronize()`` (the whole device, so TensorFlow's
  stream too) waits until TensorFlow has written this step's gradients, and also until it has finished
  reading the last step's sums out of the buckets, which are refilled now;
- after the buckets' all-reduces, the host waits for torch's stream (``work.wait()`` made it wait for
  NCCL's), because TensorFlow reads the sums on its own stream, which cannot wait for torch's.

Two waits per step, whatever the number of buckets; between them the buckets are filled and summed on
torch's streams without the host. The buckets live as long as the run (no memory returns to torch's
allocator while TensorFlow may still read it). TensorFlow adopts only 64-byte aligned memory (an unaligned
DLPack tensor aborts the process), so each gradient starts on a multiple of 16 floats of its bucket.
A gradient TensorFlow could keep past the step (a variable with ``overwrite_with_gradient``, which Keras
assigns the gradient itself) is handed back as a copy, since its bucket is refilled next step.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from .device_sum import TorchDeviceSum

FORCED = "NBDIST_TF_DEVICE_SUM"
ALIGN = 16  # float32 elements: 64 bytes, TensorFlow's alignment (EIGEN_MAX_ALIGN_BYTES)


def tf_device_sum_forced() -> bool:
    """NBDIST_TF_DEVICE_SUM=1: TensorFlow's gradients summed as torch tensors over Gloo on a CPU, the GPU's code
    path (tests, and comparing it with the numpy exchange)."""
    return os.environ.get(FORCED, "") == "1"


class TFDeviceSum:
    """sum_w (n_w / total) g_w of TensorFlow gradients, on their device (``owner``: GradientAllreduce, which
    sets ``weight`` and ``total`` before each step and counts ``seconds`` and ``steps``)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], engine: str, kept: Sequence[bool],
                 bucket_bytes: int) -> None:
        """``engine``: "nccl" (the worker's one GPU) or "gloo" (CPU tensors); ``kept``: the gradients that may
        outlive the step (handed back as copies)."""
        import torch

        from .device_sum import device_group

        self._torch = torch
        self.cuda = engine == "nccl"
        if self.cuda:
            torch.cuda.set_device(0)  # the worker's one GPU (CUDA_VISIBLE_DEVICES per rank), TensorFlow's GPU:0
        device = torch.device("cuda", 0) if self.cuda else torch.device("cpu")
        self.sum = TorchDeviceSum(shapes, device, device_group(engine), bucket_bytes, align=ALIGN)
        if any(b.data_ptr() % (4 * ALIGN) for b in self.sum.buckets):
            raise RuntimeError("torch allocated a gradient bucket that TensorFlow cannot adopt (not 64-byte aligned)")
        self.shapes = [tuple(s) for s in shapes]
        self.kept = list(kept)
        self.steps = 0  # steps this sum ran (the report says "device" only after one did)

    def reduce(self, owner: Any, dense: list[Any]) -> list[Any]:
        """The summed gradients (float32 TensorFlow tensors; ``dense`` float32, zeros where none came): traced
        into the train step, or run eagerly (a pad step)."""
        import tensorflow as tf

        present = owner._present or [True] * len(dense)
        given = [d for d, p in zip(dense, present) if p]

        def run(*tensors: Any) -> list[Any]:
            return self._run(owner, present, tensors)

        # Pinned to the worker's device: placed on the CPU, TensorFlow would copy every gradient to the host.
        with tf.device("/GPU:0" if self.cuda else "/CPU:0"):
            summed = tf.py_function(run, given, Tout=[tf.float32] * len(given), name="nbdist_device_sum")
        it = iter(summed)
        # A missing gradient stays the zeros it came as (the caller hands back None for it).
        return [tf.ensure_shape(next(it), s) if p else d for d, s, p in zip(dense, self.shapes, present)]

    def _run(self, owner: Any, present: Sequence[bool], tensors: Sequence[Any]) -> list[Any]:
        """Inside the step, eagerly: TensorFlow's tensors to torch and back, summed in between."""
        import tensorflow as tf
        from torch.utils import dlpack as torch_dlpack

        given = iter(tensors)
        grads = [torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(next(given))) if p else None
                 for p in present]
        if self.cuda:
            self._torch.cuda.synchronize()  # TensorFlow's stream: this step's gradients written, last sums read
        summed = self.sum.reduce(owner, grads)
        self.steps += 1
        out = [o.clone() if keep else o for o, keep, p in zip(summed, self.kept, present) if p]
        if self.cuda:
            self._torch.cuda.current_stream().synchronize()  # sums (and copies) written before TensorFlow reads
        return [tf.experimental.dlpack.from_dlpack(torch_dlpack.to_dlpack(o)) for o in out]

    def check(self, total: float | None = None) -> None:
        """Raise if any step since the last check summed rows other than its total (reads the device)."""
        self.sum.check(total)
