"""The Keras optimizer hook of allreduce on TensorFlow: gradients averaged across workers at every step.

Keras 3's TensorFlow trainer hands gradients to ``optimizer.apply`` inside the compiled train step; wrapping
that apply (and ``scale_loss``, which multiplies the loss by n / total so the gradients arrive weighted)
keeps ``model.fit`` whole. The result is sum_w (n_w / total) g_w, summed by the plan's engine
(machine/engines.py): the host bucket (gradient_sum.py) or torch's buckets on the device (device_sum.py).
Invariant: every worker runs the same allreduces per epoch; a shorter shard pads with zero-row steps.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from ..machine.engines import Plan
from .averaging import FlatBuffer, WeightedAverager, batch_sizes, state_digest, synced_state
from .collective import Collective
from .gradient_sum import GradientSum


def broadcast_state(collective: Collective, variables: Sequence[Any], compiled: bool = False) -> bool:
    """Give every worker rank 0's values (weights and optimizer state); whether they had to be sent.

    Every worker builds the model from the same job, so they normally hold the same values already: a
    checksum of them (``state_digest``) is compared with rank 0's first, and only on a difference are
    they broadcast (300 MB for a 25M-parameter model with Adam's slots: 2-3 s of a run's start). Under
    allreduce nothing would bring differing replicas together again, so the check is never skipped.
    Only rank 0 reads its variables and only the others write theirs. ``compiled``: TensorFlow
    variables, read by one ``tf.function`` (``FlatBuffer``).
    """
    if collective.world_size == 1 or not variables:
        return False
    mine = state_digest(variables)
    digest = np.array([float(mine)])  # a CRC-32 is exact in a float64
    collective.broadcast(digest, root=0)
    differs = np.array([0.0 if int(digest[0]) == mine else 1.0])
    collective.allreduce_sum(differs)  # one answer for all: every worker broadcasts, or none
    if differs[0] == 0:
        return False
    flat = FlatBuffer(variables, compiled=compiled)
    if collective.rank == 0:
        flat.gather()
    collective.broadcast(flat.buffer, root=0)
    if collective.rank != 0:
        flat.scatter()
    return True


class GradientAllreduce(GradientSum):
    """Sample-weighted gradient average across workers, one flat bucket per step: the train step's side
    (loss scaling, the step's share, sparse and missing gradients, pad steps, other engines)."""

    def __init__(self, collective: Collective, variables: Sequence[Any], plan: Plan | None = None,
                 loss_scaling: bool = True) -> None:
        """``loss_scaling``: scale each worker's loss by its share (TensorFlow's train step); off, the
        gradients are scaled as they are copied (backend_grads.py)."""
        super().__init__(collective, variables, plan)
        # Variables Keras assigns their gradient itself: a device sum hands theirs back as a copy.
        self._kept = [bool(getattr(v, "overwrite_with_gradient", False)) for v in variables]
        self._engine_impl = self._open_engine()
        self.loss_scale: Any = None  # n / total, multiplied into the loss by the wrapped scale_loss
        self._loss_scaled = False  # set while a train step that called scale_loss is traced
        if loss_scaling and self.sums_on_host:
            import tensorflow as tf

            self.loss_scale = tf.Variable(1.0, trainable=False, dtype=tf.as_dtype(self.dtype), name="nbdist_loss_scale")
        # A schedule (``schedule``): every step's (weight, total), found by an in-graph step counter.
        self._table: list[tuple[float, float]] | None = None
        self.step: Any = None
        self._scales: Any = None
        self._present: list[bool] | None = None
        self._sparse: list[bool] | None = None  # which variables' gradients are tf.IndexedSlices
        # Called at a pad step before its exchange: joins the sums other workers run inside their step
        # (worker/global_mask.py).
        self.before_pad: Callable[[], None] | None = None

    def _open_engine(self) -> Any:
        """The device engine (device_sum.py) where the plan sums tensors where they are; else None (the numpy
        exchange below)."""
        if not self.plan.device or self.plan.engine != "torch":
            return None
        from .device_sum import open_device_sum

        return open_device_sum(self.shapes, self.plan.mode, self.plan.bucket_bytes,
                               getattr(self.collective, "timeout", None), keras.backend.backend(), self._kept)

    @property
    def summed_by(self) -> str | None:
        """"device" once the device engine has summed a step; else how the numpy exchange sums."""
        if self._engine_impl is not None:
            return "device" if self.steps else None
        return super().summed_by

    def final_check(self) -> None:
        """At the run's end: the summed rows of the steps since the device sum last read them (up to 49 on a
        GPU, where a read waits for the device) checked against their totals, once."""
        check = getattr(self._engine_impl, "check", None)
        if check is not None:
            check()

    def _check_present(self, grads: list[Any]) -> None:
        """Every step must carry gradients for the same variables, one per trainable variable."""
        present = [g is not None for g in grads]
        if self._present is None:
            self._present = present
        elif present != self._present:
            raise RuntimeError("the set of variables with gradients changed between steps")
        if len(grads) != len(self.shapes):
            raise RuntimeError(f"{len(grads)} gradients for {len(self.shapes)} trainable variables")

    def set_weight(self, samples: float, total: float | None = None) -> None:
        """This worker's samples in the next step and (Gloo) all workers' samples in it."""
        self.weight = float(samples)
        self.total = None if total is None else float(total)
        if self.loss_scale is not None and self.total:
            self.loss_scale.assign(self.weight / self.total)

    def schedule(self, sizes: Sequence[int], totals: Sequence[int]) -> None:
        """Every step of an epoch: this worker's samples (``sizes``, then none in pad steps) and all workers'.

        Known up front (``step_totals``), they let each step find its own share in the graph from a
        step counter, instead of being told before each step from Python: several steps can then run
        in one call into TensorFlow (worker/blocks.py). Call before the train step is first traced,
        ``start_epoch`` at every epoch's start and ``advance`` after every train step (once per step,
        however many times the step applies gradients).
        """
        import tensorflow as tf

        self._table = [(float(sizes[j]) if j < len(sizes) else 0.0, float(t)) for j, t in enumerate(totals)]
        self._scales = tf.constant([w / t for w, t in self._table], dtype=tf.as_dtype(self.dtype))
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="nbdist_step")

    @property
    def scheduled(self) -> bool:
        return self._table is not None

    def start_epoch(self) -> None:
        if self.step is not None:
            self.step.assign(0)

    def advance(self) -> Any:
        """After each train step (in the graph, by the block function) and pad step: the next step's share."""
        return self.step.assign_add(1)

    def step_loss_scale(self) -> Any:
        """n / total of the step being traced or run: from the schedule, else as last set."""
        import tensorflow as tf

        if self._table is not None:
            return tf.gather(self._scales, self.step)
        return self.loss_scale

    def _at_step(self, exchange: Callable[..., list[np.ndarray]]) -> Callable[..., list[np.ndarray]]:
        """``exchange`` taking the step counter first: the step's weight and total come from the schedule."""
        def run(step: np.ndarray, *grads: np.ndarray) -> list[np.ndarray]:
            assert self._table is not None
            j = int(step)
            if not 0 <= j < len(self._table):
                raise RuntimeError(f"step {j} of an epoch of {len(self._table)} allreduce steps")
            self.weight, self.total = self._table[j]
            return exchange(*grads)

        return run

    def note_loss_scaled(self) -> None:
        """Called by the wrapped ``optimizer.scale_loss``: this step's gradients arrive scaled."""
        self._loss_scaled = True

    # -- in the train step ---------------------------------------------
    def reduce(self, grads: Sequence[Any], prescaled: bool | None = None) -> list[Any]:
        """Averaged gradients (TensorFlow tensors; None stays None). Works traced and eagerly.

        ``prescaled``: the gradients were computed from a loss multiplied by n / total (the wrapped
        ``scale_loss`` ran in this step), so they only need summing. None: tell from that.
        """
        import tensorflow as tf

        if prescaled is None:
            prescaled, self._loss_scaled = self._loss_scaled and self.loss_scale is not None, False
        if self.prescaled is None:
            self.prescaled = prescaled
        elif prescaled != self.prescaled:  # every worker's steps must take the same path on the wire
            raise RuntimeError("the train step changed between scaling the loss and not scaling it")

        grads = list(grads)
        self._check_present(grads)
        # Sparse gradients (an Embedding's tf.IndexedSlices) travel as slices through the numpy exchange
        # (``gather_slices``); a device sum sums them dense (the same gradient, the whole table's size).
        on_host = self._engine_impl is None
        sparse = [isinstance(g, tf.IndexedSlices) and on_host for g in grads]
        if self._sparse is None:
            self._sparse = sparse
        elif sparse != self._sparse:
            raise RuntimeError("the set of variables with sparse gradients changed between steps")
        # Variables without a gradient contribute zeros; the optimizer still sees None for them. A sparse
        # gradient's place in the bucket holds zeros too (its slices are gathered after the bucket's sum).
        # The host bucket's dtype (float64 for a float64 model); the device engine's buckets are float32.
        flat = tf.as_dtype(self.dtype) if on_host else tf.float32
        dense = [tf.zeros(s, flat) if g is None or sp else tf.cast(tf.convert_to_tensor(g), flat)
                 for g, s, sp in zip(grads, self.shapes, sparse)]
        if on_host:
            exchange = self.exchange_copy if prescaled else self.exchange
            # With a schedule, the step's share from its counter (which moves on after the step: ``advance``).
            fn, args = (exchange, dense) if self._table is None else (self._at_step(exchange),
                                                                      [self.step.read_value(), *dense])
            out = tf.numpy_function(fn, args, Tout=[flat] * len(dense), stateful=True,
                                    name="nbdist_gradient_allreduce")
            if not isinstance(out, (list, tuple)):  # eagerly, one output comes back bare, not in a list
                out = [out]
            out = [tf.reshape(o, s) for o, s in zip(out, self.shapes)]
            if any(sparse):
                # After the bucket's sum (which set this step's weight and total): every worker calls
                # the collectives in the same order.
                with tf.control_dependencies(out):
                    slices = self._gather_slices([g for g, sp in zip(grads, sparse) if sp], prescaled)
                it = iter(slices)
                out = [next(it) if sp else o for o, sp in zip(out, sparse)]
        else:
            out = self._device_reduce(dense)
        return [None if g is None else o if isinstance(o, tf.IndexedSlices) else tf.cast(o, g.dtype)
                for g, o in zip(grads, out)]

    def _device_reduce(self, dense: list[Any]) -> list[Any]:
        """The device engine's sum as one ``tf.py_function`` in the train step (traced, or eagerly in a pad step):
        its kernel calls Python with the gradients where they are and takes back what it returns as it is. Pinned
        to the worker's device (on the CPU, TensorFlow would copy every gradient to the host). A missing gradient
        stays the zeros it came as (the caller hands back None for it)."""
        import tensorflow as tf

        present = self._present or [True] * len(dense)

        def run(*tensors: Any) -> list[Any]:
            given = iter(tensors)
            out = self._engine_impl.reduce(self, [next(given) if p else None for p in present])
            return [o for o, p in zip(out, present) if p]

        with tf.device("/GPU:0" if self.plan.mode == "nccl" else "/CPU:0"):
            summed = iter(tf.py_function(run, [d for d, p in zip(dense, present) if p],
                                         Tout=[tf.float32] * sum(present), name="nbdist_device_sum"))
        return [tf.ensure_shape(next(summed), s) if p else d for d, s, p in zip(dense, self.shapes, present)]

    def _gather_slices(self, grads: Sequence[Any], prescaled: bool) -> list[Any]:
        """Each sparse gradient (tf.IndexedSlices) as the slices one local step on the global batch holds:
        per-row lookups' slices of every worker in rank order, broadcast lookups' summed (sparse_grads.py)."""
        return self._slices.reduce(grads, lambda *arrays: self.gather_slices(arrays, prescaled))

    def pad_step(self, apply: Callable[[list[Any]], Any], total: float | None = None) -> None:
        """Take part in one step with no samples of our own (a shorter shard's missing batch): after the sums the
        other workers run inside their step (``before_pad``: worker/global_mask.py), zeros into this step's sum,
        and the summed gradients applied, eagerly."""
        self.set_weight(0.0, total)
        if self.before_pad is not None:
            self.before_pad()
        apply(self._pad_sum(self._present or [True] * len(self.shapes)))
        if self.scheduled:
            self.advance()

    def _pad_sum(self, present: Sequence[bool]) -> list[Any]:
        """A pad step's summed gradients: TensorFlow's zeros (empty slices for a sparse gradient) reduced."""
        import tensorflow as tf

        sparse = self._sparse or [False] * len(self.shapes)
        flat = tf.as_dtype(self.dtype)  # a float64 model's pad step sums and applies float64 zeros
        zeros = [None if not p else _no_slices(s, flat) if sp else tf.zeros(s, flat)
                 for s, p, sp in zip(self.shapes, present, sparse)]
        return self.reduce(zeros, prescaled=bool(self.prescaled))


def wrap_optimizer(optimizer: Any, reducer: GradientAllreduce) -> Callable[..., Any]:
    """Make ``optimizer.apply`` average gradients first; return the original (unwrapped) apply."""
    original = optimizer.apply

    def apply(grads: Sequence[Any], trainable_variables: Any = None) -> Any:
        return original(reducer.reduce(grads), trainable_variables)

    optimizer.apply = apply  # an instance attribute: apply_gradients looks it up on self
    if reducer.loss_scale is not None:
        # Keras' train step multiplies the loss by ``scale_loss`` inside the tape (after the loss
        # metric is recorded). Scaling by this worker's share n / total there gives gradients
        # that only need summing: free, where scaling them afterwards costs a pass over them.
        original_scale = optimizer.scale_loss

        def scale_loss(loss: Any) -> Any:
            import tensorflow as tf

            reducer.note_loss_scaled()
            return original_scale(loss) * tf.cast(reducer.step_loss_scale(), loss.dtype)

        optimizer.scale_loss = scale_loss
    return original


class AllreduceCallback(keras.callbacks.Callback):
    """Tells the reducer each batch's size, pads short shards, and syncs non-trainable state.

    Each step's size and total: set by ``on_train_batch_begin`` before each step, or, when the
    reducer has the epoch's schedule (``GradientAllreduce.schedule``), found by the step itself, so
    a call may run several steps (worker/blocks.py); the span of batches it covered is then counted.
    At the end of the epoch, non-trainable float weights (e.g. BatchNorm moving
    statistics, updated locally from each worker's own batches) are averaged,
    weighted by samples, so every worker validates with the same model.
    """

    # Its batch ends run in order on the training thread, called by the worker's list (callback_list.py).
    batch_end_in_order = True

    def __init__(self, reducer: GradientAllreduce, apply: Callable[[list[Any], Any], Any],
                 trainable: Sequence[Any], samples: int, batch_size: int, steps_per_epoch: int,
                 non_trainable: WeightedAverager | None, totals: Sequence[int] | None = None) -> None:
        super().__init__()
        self.reducer = reducer
        self._apply = apply
        self._trainable = list(trainable)
        self.samples = samples
        self.sizes = batch_sizes(samples, batch_size)
        self.steps_per_epoch = steps_per_epoch
        # Every worker's samples at each step (step_totals); the Gloo path scales by n / total.
        self.totals = list(totals) if totals is not None else [None] * steps_per_epoch
        if len(self.totals) != steps_per_epoch:
            raise ValueError(f"{len(self.totals)} step totals for {steps_per_epoch} steps per epoch")
        self.non_trainable = non_trainable
        self.padded_steps = 0
        self._last_seen = -1  # the last batch a call ran, in this epoch

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._last_seen = -1
        self.reducer.start_epoch()

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if not self.reducer.scheduled:
            self.reducer.set_weight(self.sizes[batch], self.totals[batch])

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        last = len(self.sizes) - 1  # a call of several steps reports its last, possibly past the shard's end
        reached, self._last_seen = self._last_seen < last <= batch, batch
        if not reached:
            return
        if self.steps_per_epoch > len(self.sizes) or self.non_trainable is not None:
            synced_state(self.model)  # JAX: pad steps and the statistics' average act on the variables
        for step in range(len(self.sizes), self.steps_per_epoch):
            self.reducer.pad_step(lambda grads: self._apply(grads, self._trainable), self.totals[step])
            self.padded_steps += 1
        if self.non_trainable is not None:
            t0 = time.perf_counter()
            self.non_trainable.average(self.samples)
            self.reducer.seconds += time.perf_counter() - t0


def _no_slices(shape: tuple[int, ...], dtype: Any) -> Any:
    """An empty sparse gradient of ``dtype`` for a variable of ``shape`` (a pad step's share)."""
    import tensorflow as tf

    return tf.IndexedSlices(tf.zeros((0, *shape[1:]), dtype), tf.zeros((0,), tf.int64),
                            tf.constant(shape, tf.int64))
