"""Parameter averaging: every K mini-batches, a sample-weighted average of weights.

Workers may hold shards with different numbers of batches. Collectives must
pair up across workers, so every worker performs the same number of rounds per
epoch: one every K batches, one at its last batch, and then empty rounds
(contributing zero samples, receiving the average) until it has done as many as
the worker with the most batches. Every worker therefore ends each epoch -- and
starts validation -- with identical weights.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..model.spec import host_array, view_of
from .collective import Collective
from .shared import aligned_offsets, open_plan_sum, waiting


def synced_state(model: Any) -> None:
    """Put the running JAX fit's (or evaluate's) state into the model's variables; nothing elsewhere."""
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


def rounds_in_epoch(batches: int, k: int) -> int:
    return -(-batches // k)


def rounds_per_epoch(batches_per_worker: Sequence[int], k: int) -> int:
    return max(rounds_in_epoch(b, k) for b in batches_per_worker)


def batch_sizes(samples: int, batch_size: int) -> list[int]:
    full, rest = divmod(samples, batch_size)
    return [batch_size] * full + ([rest] if rest else [])


def sync_after(batch: int, batches: int, k: int) -> bool:
    """Whether a worker with ``batches`` batches averages after 0-based ``batch``."""
    return (batch + 1) % k == 0 or batch == batches - 1


# Above this many floats a round writes the variables back one by one (FlatBuffer.scatter).
EAGER_WRITE_FLOATS = 1 << 20


def buffer_dtype(variables: Sequence[Any]) -> Any:
    """float64 where any variable is float64 (summed in float32, its values would be rounded to float32), else
    float32."""
    return np.float64 if any("float64" in str(getattr(v, "dtype", "")) for v in variables) else np.float32


class FlatBuffer:
    """Variables packed into one contiguous buffer (``buffer_dtype``), so one allreduce moves them all.

    ``extra`` slots follow the variables (the averager's sample count). ``compiled``
    (TensorFlow variables): read and written by one ``tf.function`` each way, which measured 0.26 +
    0.33 ms a round for the quickstart MLP with Adam's slots, against 0.53 + 1.36 ms variable by
    variable, per round, several rounds an epoch. Otherwise variable by variable (anything with
    ``numpy()`` and ``assign()``).

    ``scatter`` writes variables of more than ``EAGER_WRITE_FLOATS`` in all one by one, dividing as it copies
    (a buffer handed whole to a ``tf.function`` is converted, split and divided: three passes).
    """

    def __init__(self, variables: Sequence[Any], extra: int = 0, compiled: bool = False) -> None:
        self.variables = list(variables)
        self.shapes = [tuple(v.shape) for v in self.variables]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self.size = int(self.offsets[-1])
        self.dtype = buffer_dtype(self.variables)
        self.buffer = np.zeros(self.size + extra, dtype=self.dtype)
        self.values = self.buffer[:self.size]  # the variables' part of the buffer
        self.compiled = bool(compiled and self.variables)
        self._read, self._write = (compiled_transfer(self.variables, self.shapes, self.dtype)
                                   if self.compiled else (None, None))

    def gather(self, scale: float = 1.0) -> np.ndarray:
        if self._read is not None:
            for part, a, b in zip(self._read(_scalar(scale, self.dtype)), self.offsets[:-1], self.offsets[1:]):
                np.copyto(self.buffer[a:b], view_of(part))
            return self.buffer
        for v, a, b in zip(self.variables, self.offsets[:-1], self.offsets[1:]):
            np.multiply(np.asarray(v.numpy(), dtype=self.dtype).reshape(-1), scale, out=self.buffer[a:b])
        return self.buffer

    def scatter(self, total: float = 1.0) -> None:
        """The variables := the buffer's values / ``total``."""
        if self._write is not None and self.size < EAGER_WRITE_FLOATS:
            self._write(self.values, _scalar(total, self.dtype))
            return
        for v, shape, a, b in zip(self.variables, self.shapes, self.offsets[:-1], self.offsets[1:]):
            # A fresh array per variable: TensorFlow may adopt an assigned array's memory as the
            # variable's own, so it must never be the buffer the next round overwrites.
            v.assign(np.divide(self.buffer[a:b], self.dtype(total)).reshape(shape))


def state_digest(variables: Sequence[Any]) -> int:
    """A checksum of the variables' bytes (CRC-32, about 3 GB/s here): equal on workers holding equal values."""
    import zlib

    digest = 0
    for v in variables:
        digest = zlib.crc32(np.ascontiguousarray(host_array(v)).view(np.uint8).reshape(-1), digest)
    return digest


def variable_views(variables: Sequence[Any]) -> list[tuple[np.ndarray, bool]] | None:
    """Each TensorFlow variable's memory as a flat, writable float32 array, and whether it is the variable's
    own memory; None unless every variable is float32 in host memory. Writing into its own memory is an
    assign without a copy: TensorFlow reads a variable's buffer when an op runs, and between steps no op
    holds it. Drop the views before the next step (TensorFlow copies a variable it updates while a view
    of it lives).

    A variable updated by a sparse op (``scatter_*``: an Embedding's rows under Keras' optimizers) is in
    TensorFlow's copy-on-read mode: every read is a fresh copy, so a write into it would be lost; its
    view is marked not its own, to be assigned back. Two reads at one address tell the variable's own.
    """
    import keras
    import tensorflow as tf

    out = []
    for v in variables:
        if isinstance(v, keras.Variable):
            v = v.value  # a Keras variable wraps a tf.Variable
        if not isinstance(v, tf.Variable) or v.dtype != tf.float32:
            return None
        tensor = v.value()
        if not tensor.device.endswith("CPU:0"):  # a GPU's memory: _numpy() would be a copy
            return None
        view = view_of(tensor)
        own = view.size == 0 or _address(view) == _address(view_of(v.value()))
        out.append((view.reshape(-1), own))
    return out


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _scalar(value: float, dtype: Any = np.float32) -> Any:
    """A scalar tensor: a NumPy or Python number would make ``tf.function`` trace again for every value."""
    import tensorflow as tf

    return tf.constant(value, dtype=tf.as_dtype(dtype))


def compiled_transfer(variables: Sequence[Any], shapes: Sequence[tuple[int, ...]], dtype: Any = np.float32
                      ) -> tuple[Callable[[Any], Any], Callable[[Any, Any], Any]]:
    """(read, write): every variable flat as ``dtype`` times a scale; and the flat buffer back, divided by a
    total, one call each."""
    import tensorflow as tf

    flat_dtype = tf.as_dtype(dtype)

    @tf.function(reduce_retracing=True)
    def read(scale: Any) -> Any:
        return [tf.reshape(tf.cast(tf.convert_to_tensor(v), flat_dtype), [-1]) * scale for v in variables]

    sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]

    @tf.function(reduce_retracing=True)
    def write(flat: Any, total: Any) -> None:
        for v, part, shape in zip(variables, tf.split(flat, sizes), shapes):
            v.assign(tf.cast(tf.reshape(part / total, shape), v.dtype))

    return read, write


class Averager:
    """What every averaging engine is: ``average(samples) -> total`` (``samples``: what this worker trained on since
    the last round; the variables set to every worker's sample-weighted average; the total: all workers' samples),
    ``seconds`` and ``rounds`` so far, ``summed_by`` (how, for reports) and ``close``. Engines define ``_round``."""

    seconds = 0.0
    rounds = 0
    summed_by = "device"

    def average(self, samples: int) -> Any:
        t0 = time.perf_counter()
        total = self._round(samples)
        self.seconds += time.perf_counter() - t0
        self.rounds += 1
        return total

    def _round(self, samples: int) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        pass


class WeightedAverager(Averager):
    """One averaging round: the sample-weighted average of every worker's variables, in ONE sum.

    Each worker contributes ``samples * weights`` and, in the buffer's last slot, ``samples``;
    after the sum the weights are divided by the summed count. One exchange per round instead of
    a count allreduce followed by a weights allreduce. ``plan`` (machine/engines.py): the buffer summed through
    shared memory where it names that engine (shared.py ``open_plan_sum``); else by the collective's allreduce.
    """

    def __init__(self, collective: Collective, variables: Sequence[Any], compiled: bool = False,
                 plan: Any = None) -> None:
        self.collective = collective
        self.flat = FlatBuffer(variables, extra=1, compiled=compiled)
        room = int(aligned_offsets([1, *self.flat.sizes])[-1])  # an in-place round's layout: the largest
        self.summer = None if plan is None else open_plan_sum(collective, room, plan, self.flat.dtype)
        self.summed_by = "allreduce" if self.summer is None else plan.summed_by
        self._plans: dict[str, Any] = {}
        self._one = np.ones(1, dtype=np.float32)  # the weight's slot in an in-place round

    def average(self, samples: int) -> int:
        """Average with every worker (one worker: nothing to do, no round counted)."""
        return samples if self.collective.world_size == 1 else super().average(samples)

    def _round(self, samples: int) -> int:
        in_place = self._in_place_plan()
        if in_place is not None:
            return self._average_in_place(samples, in_place)
        return self._average_through_buffer(samples)

    def _average_in_place(self, samples: int, plan: Any) -> int:
        """Each variable's memory into the shared segment and the average back into it, chunk by chunk
        (``average_in_place``): two passes, where a round through the buffer made eight (TensorFlow's scaled
        copy, the bucket, a divided copy, the assign's copy)."""
        views = variable_views(self.flat.variables)
        assert views is not None, "the variables were float32 in host memory when the plan was made"
        with waiting(self.collective):
            total = self.summer.average_in_place([self._one, *(a for a, _ in views)], float(samples), plan)
        if total > 0:
            for v, shape, (array, own) in zip(self.flat.variables, self.flat.shapes, views):
                if not own:  # a copy-on-read variable: the average went into a copy of it
                    v.assign(array.reshape(shape))
        del views  # TensorFlow copies a variable it updates while a view of it lives
        return int(total)

    def _average_through_buffer(self, samples: int) -> int:
        flat = self.flat
        if samples:
            flat.gather(float(samples))
        else:
            flat.values.fill(0.0)
        flat.buffer[-1] = samples
        if self.summer is None:
            self.collective.allreduce_sum(flat.buffer)
        else:
            with waiting(self.collective):
                self.summer(flat.buffer)
        total = int(round(float(flat.buffer[-1])))
        if total > 0:
            flat.scatter(total)
        return total

    def _in_place_plan(self) -> Any:
        """The layout of an in-place round (the weight, then each variable, aligned), or None when a round
        goes through the buffer: not a shared-memory sum, or a variable not float32 in host memory."""
        if "in place" not in self._plans:
            plan = None
            if self.summer is not None and self.flat.compiled and variable_views(self.flat.variables) is not None:
                offsets = aligned_offsets([1, *self.flat.sizes])
                plan = self.summer.plan([int(o) for o in offsets[:-1]], [1, *self.flat.sizes], int(offsets[-1]))
            self._plans["in place"] = plan
        return self._plans["in place"]

    def close(self) -> None:
        if self.summer is not None:
            self.summer.close()
