"""The host side of allreduce: each step's gradients in one aligned bucket, summed over the workers.

numpy in, numpy out, no Keras (the optimizer hooks are allreduce_hook.py and backend_grads.py). The result is
the sample-weighted average sum_w (n_w / total) g_w; the bucket's last slot carries each worker's rows, and the
summed rows must equal the step's total. The plan's engine sums it (machine/engines.py): shared memory reading
the gradients where they are (shared.py, one row or chunk by chunk), or the collective's allreduce (Gloo,
between machines). Every gradient starts on a 64-byte boundary, so TensorFlow adopts the summed views without a
copy; a bucket still lent to TensorFlow is never refilled.
"""
from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..machine.engines import Plan
from .averaging import batch_sizes, buffer_dtype
from .collective import Collective
from .shared import aligned_offsets, fill, open_plan_sum, pieces, waiting
from .sparse_grads import SliceExchange

log = logging.getLogger(__name__)


def shard_samples(collective: Collective, samples: int) -> list[int]:
    """Every worker's number of training samples, by rank (one small allreduce at the start)."""
    counts = np.zeros(collective.world_size, dtype=np.float64)
    counts[collective.rank] = samples
    collective.allreduce_sum(counts)
    return [int(c) for c in counts]


def step_totals(samples_per_worker: Sequence[int], batch_size: int | Sequence[int]) -> list[int]:
    """Samples summed over workers at each step of an epoch; len() is the steps every worker runs.

    Worker w's step j holds ``batch_sizes(samples_w, batch_size)[j]`` samples, or none when its
    shard has run out (a pad step), so every step's total is known before the step runs.
    ``batch_size`` may differ by worker (an intercepted fit's global batch split over the workers).
    """
    sizes = [batch_size] * len(samples_per_worker) if isinstance(batch_size, int) else list(batch_size)
    per_worker = [batch_sizes(int(s), int(b)) for s, b in zip(samples_per_worker, sizes)]
    steps = max((len(b) for b in per_worker), default=0)
    return [sum(b[j] for b in per_worker if j < len(b)) for j in range(steps)]


class GradientSum:
    """The exchange of one step's gradients: a flat, aligned bucket summed across workers by the plan's engine.

    ``weight`` (this worker's samples in the step) and ``total`` (all workers') are set before each
    exchange by the hook (``allreduce_hook.GradientAllreduce``), which calls ``exchange`` or ``exchange_copy``
    from the train step through ``tf.numpy_function``.
    """

    def __init__(self, collective: Collective, variables: Sequence[Any], plan: Plan | None = None) -> None:
        """``plan``: the engine (machine/engines.py); None: the collective's allreduce of the host bucket."""
        self.collective = collective
        self.plan = plan if plan is not None else Plan("torch", "gloo")
        self.shapes = [tuple(v.shape) for v in variables]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = aligned_offsets(self.sizes)
        self.dtype = buffer_dtype(variables)  # float64 for a float64 model: its sums not rounded to float32
        # Gradients then, in the last slot, this worker's sample count: the summed count checks
        # that every worker agreed on the step's total.
        count_at = int(self.offsets[-1])
        self._buckets = [_Bucket(count_at + 1, self.dtype)]
        self.buffer = self._buckets[0].data  # the bucket of the latest step
        self._layout = pieces([*self.offsets[:-1], count_at], [*self.sizes, 1], 0, count_at + 1)
        self.prescaled: bool | None = None  # which exchange the train step uses, fixed when first traced
        inner = getattr(collective, "inner", collective)  # PhaseCollective wraps the engine
        # Several workers summing host buckets (not the tensors where they are).
        self.sums_on_host = inner.world_size > 1 and self.plan.engine in ("shared", "torch") and not self.plan.device
        self._shared = open_plan_sum(collective, count_at + 1, self.plan, self.dtype) if self.sums_on_host else None
        if self._shared is not None:
            self._shared_plan = self._shared.plan([*self.offsets[:-1], count_at], [*self.sizes, 1], count_at + 1)
        elif self.plan.engine == "shared":  # the segment could not be mapped: Gloo
            self.plan = Plan("torch", "gloo", notice=self.plan.notice)
        self.weight = 0.0  # samples in this worker's current batch; set before each step
        self.total: float | None = None  # samples of all workers in the current step
        self.seconds = 0.0  # wall time spent synchronising (read by the progress callback)
        self.steps = 0
        self._slices = SliceExchange(collective)  # sparse gradients' exchange (sparse_grads.py)

    @property
    def summed_by(self) -> str | None:
        """How the steps are summed (``Plan.summed_by``); None before the step is traced, or for one worker."""
        return None if self.prescaled is None and not self.steps else self.plan.summed_by

    def exchange(self, *grads: np.ndarray) -> list[np.ndarray]:
        """Sum ``(weight / total) * grads`` across workers; return the averaged gradients.

        Called by TensorFlow (``tf.numpy_function``) with numpy views of the gradients.
        """
        return self._copy_and_sum(grads, scale=True)

    def exchange_copy(self, *grads: np.ndarray) -> list[np.ndarray]:
        """Sum gradients already scaled through the loss (n / total): copied into the bucket, or read where they are
        by the chunked shared-memory sum (no pass over them besides the sum itself)."""
        return self._copy_and_sum(grads, scale=False)

    def _copy_and_sum(self, grads: Sequence[np.ndarray], scale: bool) -> list[np.ndarray]:
        """The gradients, each times n / total (``scale``; else as they are; zeros in a pad step), and the rows,
        read where they are by the shared-memory sum, else copied into the bucket and summed there."""
        t0 = time.perf_counter()
        n, total = self.weight, self._check_total()
        factor = self.dtype(n / total) if scale or n == 0 else None
        arrays = [np.reshape(g, -1) for g in grads] + [np.array([n], dtype=self.dtype)]
        scales = [factor] * len(grads) + [None]
        bucket = self._free_bucket()
        self.buffer = bucket.data
        if self._shared is not None:
            with waiting(self.collective):
                self._shared.sum_into(arrays, bucket.data, self._shared_plan, scales)
        else:
            fill(bucket.data, 0, self._layout, arrays, scales)
            self.collective.allreduce_sum(bucket.data)
        return self._hand_back(bucket, total, t0)

    def close(self) -> None:
        """The run's end (the segment stays mapped until the process ends)."""

    def _check_total(self) -> float:
        if self.total is None or self.total <= 0:
            raise RuntimeError("the step's total sample count must be set (set_weight(samples, total)) "
                               "and positive before each allreduce step")
        return self.total

    def _hand_back(self, bucket: _Bucket, total: float, t0: float) -> list[np.ndarray]:
        """Check the summed sample count; return the gradients as views of the bucket."""
        buf = bucket.data
        if buf[-1] != total:
            raise RuntimeError(f"workers disagree on this step's samples: {float(buf[-1]):g} summed, "
                               f"{total:g} expected")
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        # Views of the bucket, handed to TensorFlow without a copy; watched so that the bucket is
        # not refilled while TensorFlow still holds one (see _free_bucket).
        out = [buf[a:a + size].reshape(s) for s, a, size in zip(self.shapes, self.offsets[:-1], self.sizes)]
        bucket.lent = [weakref.ref(o) for o in out]
        return out

    def _free_bucket(self) -> _Bucket:
        """A bucket no TensorFlow tensor still shares memory with (normally the one of last step)."""
        for bucket in self._buckets:
            if not bucket.in_use():
                return bucket
        # Something kept a gradient tensor (e.g. a variable assigned it): leave that bucket to it.
        # At most two are kept; a dropped one is freed when TensorFlow lets go of it.
        log.debug("gradient bucket still referenced by TensorFlow; using a new one")
        bucket = _Bucket(len(self._buckets[0].data), self.dtype)
        self._buckets = self._buckets[-1:] + [bucket]
        return bucket

    def gather_slices(self, arrays: Sequence[np.ndarray], prescaled: bool) -> list[np.ndarray]:
        """numpy side of the hook's ``_gather_slices``: this step's rows and scale; a pad step (weight 0) adds
        no slices."""
        t0 = time.perf_counter()
        n, total = self.weight, self._check_total()
        out = self._slices.exchange(arrays, n, None if prescaled else n / total)
        self.seconds += time.perf_counter() - t0
        return out


def _aligned_zeros(length: int, dtype: Any = np.float32, align_bytes: int = 64) -> np.ndarray:
    """A zero array of ``dtype`` whose data starts on an ``align_bytes`` boundary."""
    item = np.dtype(dtype).itemsize
    raw = np.zeros(length + align_bytes // item, dtype=dtype)
    shift = (-raw.ctypes.data % align_bytes) // item
    return raw[shift:shift + length]


class _Bucket:
    """One aligned bucket and weak references to the views of it lent to TensorFlow."""

    def __init__(self, length: int, dtype: Any = np.float32) -> None:
        self.data = _aligned_zeros(length, dtype)
        self.lent: list[weakref.ref] = []

    def in_use(self) -> bool:
        return any(ref() is not None for ref in self.lent)
