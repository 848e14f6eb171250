"""Synchronous data parallelism: gradients averaged across workers at every step.

Keras 3's TensorFlow trainer hands gradients to ``optimizer.apply`` inside the
compiled train step; that is the one place to intervene, so ``model.fit`` keeps
its callbacks, metrics, validation and History. The optimizer's ``apply`` is
wrapped on this worker's instance: the gradients are scaled by the samples in
this worker's batch, packed with that count into ONE flat buffer, summed across
workers in one allreduce, and divided by the summed count -- a sample-weighted
average, so a short last batch counts for what it holds.

Every worker must run the same number of allreduces per epoch or the collective
deadlocks. A worker whose shard has fewer batches runs the missing steps after
its last batch: it contributes zero samples and applies the averaged gradient
like everyone else, so all workers keep identical weights.

Engines: Gloo (CPU; the tensors cross via ``tf.numpy_function`` as numpy views
and ``torch.from_numpy``, so no copy besides the one into the bucket) is the
tested path. NCCL (GPU; DLPack) and Horovod's raw ops are written to the same
shape but NOT VERIFIED: there is no GPU and no importable Horovod where this
was built.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Sequence

import keras
import numpy as np

from ..collective import Collective
from .averaging import FlatBuffer, WeightedAverager, batch_sizes

log = logging.getLogger(__name__)


def common_steps(collective: Collective, batches: int) -> int:
    """The most batches any worker has in an epoch (every worker runs that many steps)."""
    counts = np.zeros(collective.world_size, dtype=np.float64)
    counts[collective.rank] = batches
    collective.allreduce_sum(counts)
    return int(counts.max())


def broadcast_state(collective: Collective, variables: Sequence[Any]) -> None:
    """Give every worker rank 0's values (weights and optimizer state) in one broadcast."""
    if collective.world_size == 1 or not variables:
        return
    flat = FlatBuffer(variables)
    flat.gather()
    collective.broadcast(flat.buffer, root=0)
    flat.scatter()


class GradientAllreduce:
    """Sample-weighted gradient average across workers, one flat bucket per step."""

    def __init__(self, collective: Collective, variables: Sequence[Any], engine: str = "gloo") -> None:
        self.collective = collective
        self.engine = engine
        self.shapes = [tuple(v.shape) for v in variables]
        sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        # Gradients then, in the last slot, this worker's sample count: one allreduce carries both.
        self.buffer = np.zeros(int(self.offsets[-1]) + 1, dtype=np.float32)
        self.weight = 0.0  # samples in this worker's current batch; set before each step
        self.seconds = 0.0  # wall time spent synchronising (read by the progress callback)
        self.steps = 0
        self._present: list[bool] | None = None
        self._weight_var = None
        self._engine_impl: Any = None
        if engine == "nccl":
            self._engine_impl = _NcclEngine()
        elif engine == "horovod":
            self._engine_impl = _HorovodEngine()
        if engine != "gloo":
            import tensorflow as tf

            self._weight_var = tf.Variable(0.0, trainable=False, dtype=tf.float32, name="nbdist_batch_samples")

    def set_weight(self, samples: float) -> None:
        self.weight = float(samples)
        if self._weight_var is not None:
            self._weight_var.assign(self.weight)

    # -- the Gloo path: numpy in, numpy out ------------------------------
    def exchange(self, *grads: np.ndarray) -> list[np.ndarray]:
        """Sum ``weight * grads`` and the weight across workers; return the averaged gradients.

        Called by TensorFlow (``tf.numpy_function``) with numpy views of the gradients.
        """
        t0 = time.perf_counter()
        buf, n = self.buffer, self.weight
        if n == 0:
            buf.fill(0.0)
        else:
            for g, a, b in zip(grads, self.offsets[:-1], self.offsets[1:]):
                np.multiply(np.reshape(g, -1), np.float32(n), out=buf[a:b], casting="same_kind")
        buf[-1] = n
        self.collective.allreduce_sum(buf)
        total = float(buf[-1])
        if total <= 0:
            raise RuntimeError("an allreduce step in which no worker had any samples")
        # Averaged in place and handed back as views: no 100 MB allocation per step. Safe because
        # the optimizer consumes them within this step, before the next step refills the bucket.
        averaged = buf[:-1]
        averaged *= np.float32(1.0 / total)
        self.seconds += time.perf_counter() - t0
        self.steps += 1
        return [averaged[a:b].reshape(s) for s, a, b in zip(self.shapes, self.offsets[:-1], self.offsets[1:])]

    # -- in the train step ---------------------------------------------
    def reduce(self, grads: Sequence[Any]) -> list[Any]:
        """Averaged gradients (TensorFlow tensors; None stays None). Works traced and eagerly."""
        import tensorflow as tf

        grads = list(grads)
        present = [g is not None for g in grads]
        if self._present is None:
            self._present = present
        elif present != self._present:
            raise RuntimeError("the set of variables with gradients changed between steps")
        if len(grads) != len(self.shapes):
            raise RuntimeError(f"{len(grads)} gradients for {len(self.shapes)} trainable variables")
        # Variables without a gradient contribute zeros; the optimizer still sees None for them.
        dense = [tf.zeros(s, tf.float32) if g is None else tf.cast(tf.convert_to_tensor(g), tf.float32)
                 for g, s in zip(grads, self.shapes)]
        if self.engine == "gloo":
            out = tf.numpy_function(self.exchange, dense, Tout=[tf.float32] * len(dense), stateful=True,
                                    name="nbdist_gradient_allreduce")
            out = [tf.reshape(o, s) for o, s in zip(out, self.shapes)]
        else:
            out = self._engine_impl.reduce(self, dense)
        return [None if g is None else tf.cast(o, g.dtype) for g, o in zip(grads, out)]

    def pad_step(self, apply: Callable[[list[Any]], Any]) -> None:
        """Take part in one step with no samples of our own (a shorter shard's missing batch)."""
        import tensorflow as tf

        self.set_weight(0.0)
        present = self._present or [True] * len(self.shapes)
        zeros = [tf.zeros(s, tf.float32) if p else None for s, p in zip(self.shapes, present)]
        apply(self.reduce(zeros))


def wrap_optimizer(optimizer: Any, reducer: GradientAllreduce) -> Callable[..., Any]:
    """Make ``optimizer.apply`` average gradients first; return the original (unwrapped) apply."""
    original = optimizer.apply

    def apply(grads: Sequence[Any], trainable_variables: Any = None) -> Any:
        return original(reducer.reduce(grads), trainable_variables)

    optimizer.apply = apply  # an instance attribute: apply_gradients looks it up on self
    return original


class AllreduceCallback(keras.callbacks.Callback):
    """Tells the reducer each batch's size, pads short shards, and syncs non-trainable state.

    ``on_train_batch_begin`` runs before each step (steps_per_execution is 1).
    At the end of the epoch, non-trainable float weights (e.g. BatchNorm moving
    statistics, updated locally from each worker's own batches) are averaged,
    weighted by samples, so every worker validates with the same model.
    """

    def __init__(self, reducer: GradientAllreduce, apply: Callable[[list[Any], Any], Any],
                 trainable: Sequence[Any], samples: int, batch_size: int, steps_per_epoch: int,
                 non_trainable: WeightedAverager | None) -> None:
        super().__init__()
        self.reducer = reducer
        self._apply = apply
        self._trainable = list(trainable)
        self.samples = samples
        self.sizes = batch_sizes(samples, batch_size)
        self.steps_per_epoch = steps_per_epoch
        self.non_trainable = non_trainable
        self.padded_steps = 0

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.reducer.set_weight(self.sizes[batch])

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch != len(self.sizes) - 1:
            return
        for _ in range(self.steps_per_epoch - len(self.sizes)):
            self.reducer.pad_step(lambda grads: self._apply(grads, self._trainable))
            self.padded_steps += 1
        if self.non_trainable is not None:
            t0 = time.perf_counter()
            self.non_trainable.average(self.samples)
            self.reducer.seconds += time.perf_counter() - t0


# -- engines that could not be run here ------------------------------------
class _NcclEngine:
    """NCCL through torch.distributed, tensors via DLPack. NOT VERIFIED: written without a GPU.

    The worker sees exactly one GPU (CUDA_VISIBLE_DEVICES set per rank), so it is
    device 0. An NCCL group is made beside the Gloo group on the same store.
    The bucket is built by TensorFlow on the GPU and summed in place by NCCL.
    """

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        torch.cuda.set_device(0)
        self._torch, self._dist = torch, dist
        self.group = dist.new_group(backend="nccl")

    def reduce(self, owner: GradientAllreduce, dense: list[Any]) -> list[Any]:
        import tensorflow as tf

        n = owner._weight_var.read_value()
        flat = tf.concat([tf.reshape(g, [-1]) * n for g in dense] + [tf.reshape(n, [1])], axis=0)

        def allreduce(t: Any) -> Any:
            t0 = time.perf_counter()
            from torch.utils import dlpack as torch_dlpack

            x = torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(t))
            self._torch.cuda.synchronize()  # TensorFlow's stream must have finished writing the bucket
            self._dist.all_reduce(x, group=self.group)
            self._torch.cuda.synchronize()
            out = tf.experimental.dlpack.from_dlpack(torch_dlpack.to_dlpack(x))
            owner.seconds += time.perf_counter() - t0
            owner.steps += 1
            return out

        summed = tf.py_function(allreduce, [flat], Tout=tf.float32)
        averaged = summed[:-1] / summed[-1]
        return _split(averaged, owner)


class _HorovodEngine:
    """Horovod's raw ops (``grouped_allreduce``), for images that ship a working Horovod.

    NOT VERIFIED: Horovod does not build against TensorFlow 2.21 here. Horovod
    needs its own launcher's rendezvous (horovodrun / mpirun) for ``hvd.init()``;
    when that fails the worker reports it like any other error.
    """

    def __init__(self) -> None:
        import horovod.tensorflow as hvd

        hvd.init()
        self.hvd = hvd

    def reduce(self, owner: GradientAllreduce, dense: list[Any]) -> list[Any]:
        import tensorflow as tf

        n = owner._weight_var.read_value()
        summed = self.hvd.grouped_allreduce([g * n for g in dense] + [tf.reshape(n, [1])], op=self.hvd.Sum)
        total = summed[-1][0]
        return [s / total for s in summed[:-1]]


def _split(flat: Any, owner: GradientAllreduce) -> list[Any]:
    import tensorflow as tf

    return [tf.reshape(flat[int(a):int(b)], s) for s, a, b in zip(owner.shapes, owner.offsets[:-1], owner.offsets[1:])]
