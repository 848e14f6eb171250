"""TensorFlow's gradients (and averaging rounds) summed where they are: handed to torch's device buckets by
DLPack (no copy), summed by ``device_sum.TorchDeviceSum``, handed back by DLPack.

NCCL on GPUs (a GPU per worker); ``device_sum="always"`` runs the same code on CPU tensors over Gloo, as the
tests do. Invariants: every gradient starts 64-byte aligned in its bucket (TensorFlow adopts nothing else), a
gradient TensorFlow may keep is handed back as a copy, and on a GPU the host waits for both streams once
before and once after the sums (``TFDeviceSum``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .device_sum import TorchDeviceAverage, TorchDeviceSum, engine_device

ALIGN = 16  # float32 elements: 64 bytes, TensorFlow's alignment (EIGEN_MAX_ALIGN_BYTES)


def check_aligned(buckets: Sequence[Any]) -> None:
    if any(b.data_ptr() % (4 * ALIGN) for b in buckets):
        raise RuntimeError("torch allocated a bucket that TensorFlow cannot adopt (not 64-byte aligned)")


class TFDeviceSum:
    """sum_w (n_w / total) g_w of TensorFlow gradients, on their device (``owner``: GradientAllreduce, which
    sets ``weight`` and ``total`` before each step and counts ``seconds`` and ``steps``).

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

    def __init__(self, shapes: Sequence[tuple[int, ...]], engine: str, kept: Sequence[bool],
                 bucket_bytes: int, timeout: float | None = None) -> None:
        """``engine``: "nccl" (the worker's one GPU) or "gloo" (CPU tensors); ``kept``: the gradients that may
        outlive the step (handed back as copies); ``timeout``: nbdist's sync timeout (``device_group``)."""
        import torch

        from .device_sum import device_group

        self._torch = torch
        self.cuda = engine == "nccl"
        self.sum = TorchDeviceSum(shapes, engine_device(engine), device_group(engine, timeout), bucket_bytes,
                                  align=ALIGN)
        check_aligned(self.sum.buckets)
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


class TFDeviceAverage(TorchDeviceAverage):
    """The averaging strategy's round on TensorFlow's variables, on their device: each variable's value handed to
    torch by DLPack (no copy) and copied into ``TorchDeviceAverage``'s buckets, which are all-reduced (NCCL on the
    worker's GPU; Gloo on CPU tensors with device_sum="always", the tests); each sum handed back to TensorFlow
    by DLPack (no copy), divided by the total there and assigned to its variable.

    The round runs eagerly between TensorFlow's calls (worker/callbacks.py). Streams (NOT RUN ON A GPU):

    - after every variable is read (a copy-on-read variable's read queues a copy on TensorFlow's stream), one
      ``torch.cuda.synchronize()`` waits for TensorFlow's stream: the steps that wrote the variables, and the
      last round's divisions, which read the buckets refilled now;
    - reading the summed samples (the total to divide by) makes the host wait for torch's stream, which waited
      for NCCL's: the buckets hold the sums before TensorFlow's stream reads them. Only then are the variables'
      values handed to torch dropped (TensorFlow may reuse their memory, which torch's stream read until then).

    Two waits per round, whatever the number of buckets. TensorFlow's assign adopts the tensor it is given
    (copy-on-write): assigned a bucket's slice itself, a variable would live in the bucket, refilled next round
    and written in place by the optimizer. So the division is TensorFlow's, and its result, memory of
    TensorFlow's own, is what is assigned. Each variable starts on 64 bytes of its bucket (ALIGN) for
    TensorFlow to adopt its slice for the division.
    """

    def __init__(self, variables: Sequence[Any], engine: str, bucket_bytes: int, timeout: float | None = None) -> None:
        """``timeout``: nbdist's sync timeout (``device_group``)."""
        from .device_sum import device_group

        self.cuda = engine == "nccl"
        self._read_cuda = False  # a variable read from a GPU this round (also under Gloo on a GPU's host)
        super().__init__(variables, engine_device(engine), device_group(engine, timeout), bucket_bytes,
                         align=ALIGN)
        check_aligned(self.buckets)

    def _read(self, i: int) -> Any:
        import tensorflow as tf
        from torch.utils import dlpack as torch_dlpack

        value = torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(tf.convert_to_tensor(self.variables[i])))
        self._read_cuda = self._read_cuda or value.is_cuda
        return value

    def _ready(self) -> None:
        # TensorFlow's stream: the variables written, the last round's sums read. Also where the buckets are on the
        # CPU (Gloo) but the variables on a GPU: torch's copy out of them would not wait for TensorFlow's stream.
        if self.cuda or self._read_cuda:
            self._torch.cuda.synchronize()
        self._read_cuda = False

    def _write(self, i: int, summed: Any, total: float) -> None:
        import tensorflow as tf
        from torch.utils import dlpack as torch_dlpack

        v = self.variables[i]
        adopted = tf.experimental.dlpack.from_dlpack(torch_dlpack.to_dlpack(summed))
        v.assign(tf.cast(tf.reshape(adopted, self.shapes[i]) / total, v.dtype))
