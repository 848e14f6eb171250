"""Keras callbacks that run inside a worker: averaging rounds and the event stream."""
from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from ..model.spec import host_array
from ..strategies.averaging import WeightedAverager, batch_sizes, sync_after
from ..strategies.backend_grads import synced_state
from ..wire.messages import BatchSummaries
from ..wire.reports import Epoch, Progress, Weights
from .blocks import BatchSpan


def notebook_callbacks(swap_ema: bool, raise_on_nan: bool, summaries: BatchSummaries | None = None) -> list[Any]:
    """Keras' own callbacks of the notebook's that act inside this worker's passes (driver/callbacks.py)."""
    out: list[Any] = []
    if summaries is not None:  # first, as the notebook's TensorBoard comes before the others it may trace
        out.append(PassSummaries(summaries))
    if swap_ema:  # validation with the moving averages; the epoch's end (weights shipped) without them
        out.append(keras.callbacks.SwapEMAWeights(swap_on_epoch=False))
    if raise_on_nan:
        out.append(keras.callbacks.TerminateOnNaN(raise_error=True))
    return out


class PassSummaries(keras.callbacks.TensorBoard):
    """Worker 0's half of the notebook's TensorBoard: what Keras' TensorBoard writes inside the passes (the
    batch scalars, the model's own summaries, the profiled batches, the train graph), into the same log
    directory. The epoch's scalars, the evaluation curve, histograms and embeddings are the notebook's copy's,
    written from the merged logs; this one writes none of them. Batch scalars are worker 0's share of each
    global batch (its running means), the step is the global step."""

    def __init__(self, summaries: BatchSummaries) -> None:
        # No profiled batch is 0, as Keras takes it: on torch any other value raises
        profile = tuple(summaries.profile_batch) if any(summaries.profile_batch) else 0
        super().__init__(summaries.log_dir, update_freq=summaries.update_freq or "epoch", profile_batch=profile,
                         write_graph=False, write_steps_per_second=summaries.write_steps_per_second)
        self._train_graph = summaries.write_graph

    def set_model(self, model: Any) -> None:
        super().set_model(model)  # the model's summary is the notebook's copy's (write_graph=False here)
        self._should_write_train_graph = self._train_graph

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        pass  # the notebook writes the epoch's merged scalars

    def on_test_end(self, logs: Any = None) -> None:
        self._pop_writer()  # the notebook writes evaluation_*_vs_iterations from the merged logs


class AveragingCallback(keras.callbacks.Callback):
    """Averages weights every K batches and pads each epoch to the common number of rounds."""

    # Its batch ends run in order on the training thread, called by the worker's list (callback_list.py).
    batch_end_in_order = True

    def __init__(self, averager: WeightedAverager, k: int, samples: int, batch_size: int,
                 rounds_per_epoch: int, sizes: Sequence[int] | None = None) -> None:
        super().__init__()
        self.averager = averager
        self.k = k
        # Rows of each batch: known from the shard, or (a PyDataset's share) as its batches are read.
        self.sizes = sizes if sizes is not None else batch_sizes(samples, batch_size)
        self.rounds_per_epoch = rounds_per_epoch
        self.span = BatchSpan(self.sizes)  # a call may run several batches (blocks.py)
        self._pending = 0
        self._rounds = 0
        self.before_pad: Callable[[], None] | None = None  # before each padding round (K=1: global_mask.py)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.span.reset()
        self._pending = 0
        self._rounds = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        batches = len(self.sizes)
        if any(sync_after(b, batches, self.k) for b in range(self.span.next, min(batch, batches - 1) + 1)):
            synced_state(self.model)  # JAX: the variables hold the step's state before they are averaged
        for b in self.span.advance(batch):
            self._pending += self.sizes[b]
            if sync_after(b, batches, self.k):
                self._round()
        if self.span.next == batches:
            while self._rounds < self.rounds_per_epoch:
                if self.before_pad is not None:
                    self.before_pad()
                self._round()

    def _round(self) -> None:
        self.averager.average(self._pending)
        self._pending = 0
        self._rounds += 1


def split_logs(logs: Any) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """An epoch's logs as they travel: the scalars as floats, the array results (``F1Score`` per class) as
    arrays; anything else (a string a callback put there) stays on the worker."""
    scalars: dict[str, float] = {}
    results: dict[str, np.ndarray] = {}
    for key, value in (logs or {}).items():
        try:
            scalars[key] = float(value)
        except (TypeError, ValueError):
            value = np.asarray(keras.ops.convert_to_numpy(value)) if keras.ops.is_tensor(value) else value
            if isinstance(value, np.ndarray) and value.dtype.kind in "fiub":
                results[key] = value
    return scalars, results


def metric_directions(model: Any) -> dict[str, str]:
    """Each compiled metric's direction ("up" or "down") by name, from the metrics Keras' ``MonitorCallback``
    looks among (its ``_set_monitor_op``): they exist once a step has built them, which the notebook's model
    never takes, so the workers send them (``Epoch.directions``)."""
    from keras.src.trainers.compile_utils import CompileMetrics, MetricsList

    out: dict[str, str] = {}
    for group in getattr(model, "metrics", None) or []:
        if isinstance(group, (CompileMetrics, MetricsList)):
            for metric in group.metrics:
                direction = getattr(metric, "_direction", None)
                if direction in ("up", "down"):
                    out[metric.name] = direction
    return out


class EventCallback(keras.callbacks.Callback):
    """Streams progress and per-epoch metrics to the driver; rank 0 also ships the weights."""

    # It only counts batches and sends messages (the channel is thread-safe), so Keras may
    # call its batch hook off the training thread instead of blocking every step on it.
    async_safe = True

    def __init__(self, send: Callable[..., None], samples: int, val_samples: int, batch_size: int,
                 averager: WeightedAverager | None, ship_weights: Callable[[int], None] | None,
                 interval: float = 0.25, sizes: Sequence[int] | None = None) -> None:
        super().__init__()
        self.send = send
        self.samples = samples
        self.val_samples = val_samples
        self.sizes = sizes if sizes is not None else batch_sizes(samples, batch_size)
        self.averager = averager
        self.ship_weights = ship_weights
        self.interval = interval
        self.span = BatchSpan(self.sizes)  # a call may run several batches (blocks.py)
        self._samples_done = 0
        self._train_start = time.perf_counter()
        self._epoch_start = 0.0
        self._last_sent = 0.0
        self._epoch = 0

    def _timing(self) -> dict[str, float]:
        sync = self.averager.seconds if self.averager else 0.0
        total = time.perf_counter() - self._train_start
        return {"sync_seconds": sync, "compute_seconds": max(0.0, total - sync)}

    def on_train_begin(self, logs: Any = None) -> None:
        self._train_start = time.perf_counter()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch
        self._epoch_start = time.perf_counter()
        self.span.reset()
        self.send(Progress("training", epoch, 0, len(self.sizes), self._samples_done, **self._timing()))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._samples_done += sum(self.sizes[b] for b in self.span.advance(batch))
        now = time.perf_counter()
        if now - self._last_sent >= self.interval:
            self._last_sent = now
            self.send(Progress("training", self._epoch, self.span.next, len(self.sizes), self._samples_done,
                               **self._timing()))

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.ship_weights is not None:
            self.ship_weights(epoch)
        scalars, results = split_logs(logs)
        self.send(Epoch(epoch, scalars, self.samples, self.val_samples, time.perf_counter() - self._epoch_start,
                        batch=len(self.sizes), batches=len(self.sizes), samples_done=self._samples_done,
                        array_names=list(results), array_logs=list(results.values()),
                        directions=metric_directions(self.model), **self._timing()))


def weights_and_optimizer(model: Any) -> tuple[list[np.ndarray], list[list[int]]]:
    """The whole trained state (weights, then every optimizer's), and where each optimizer's variables are:
    read where it lies when it can be (``host_array``), so send it at once or copy it (``WeightShipper``)."""
    from ..model.spec import optimizer_layout, optimizer_state_variables

    variables = [*model.weights, *optimizer_state_variables(model)]
    return [host_array(v) for v in variables], optimizer_layout(model)


def device_copies(variables: list[Any], kept: list[Any]) -> list[Any] | None:
    """The variables' values copied on their GPU, into ``kept`` when it fits (torch) or fresh (JAX's arrays
    are immutable; its step may donate the old ones); None unless every value lies on a GPU. On a GPU the
    copy takes about a millisecond where one into host memory takes tens for a large model: the epoch's
    state waits there until it is sent (``host_copy``)."""
    import keras

    backend = keras.backend.backend()
    values = [getattr(v, "value", None) for v in variables]
    if backend == "torch":
        if not values or not all(getattr(t, "is_cuda", False) for t in values):
            return None
        import torch

        with torch.no_grad():
            if [(k.shape, k.dtype) for k in kept] != [(t.shape, t.dtype) for t in values]:
                return [t.detach().clone() for t in values]
            for k, t in zip(kept, values):
                k.copy_(t)
        return kept
    if backend == "jax":
        if not values or not all(getattr(d, "platform", "cpu") == "gpu" for t in values
                                 for d in getattr(t, "devices", lambda: [])()):
            return None
        import jax.numpy as jnp

        return [jnp.array(t, copy=True) for t in values]
    return None


def host_copy(value: Any) -> np.ndarray:
    """A value kept by ``device_copies``, or a host array, as a NumPy array."""
    if isinstance(value, np.ndarray):
        return value
    cpu = getattr(value, "cpu", None)  # a torch tensor
    return np.asarray(cpu() if cpu is not None and callable(cpu) else value)


class WeightShipper:
    """Rank 0's synchronised weights, optimizer state and step count, for the driver.

    Called at every epoch end. ``every_epoch`` (the driver's choice, ``TrainSettings``): sent at
    once, for checkpoints or callbacks that read the model. Otherwise only a copy is kept, and it
    is sent once: when training ends (``finish``), or when the driver stops the run and asks for
    it (``on_stop``, on the link's reader thread) so the model keeps the last epoch's weights.
    The copy goes into buffers kept from one epoch to the next (a fresh 300 MB each epoch cost its
    page faults too), and after the ``epochs``-th epoch none is made: nothing trains after it, so the
    state is read where it lies when it is sent.
    """

    def __init__(self, send: Callable[..., None], model: Any, every_epoch: bool = True,
                 epochs: int | None = None) -> None:
        self.send, self.model, self.every_epoch = send, model, every_epoch
        self.final_epoch = epochs - 1 if epochs else None
        self.sent = 0  # weight messages sent (the closing report says how many)
        # The latest epoch's message (its state not in it yet), not yet sent, and its state (None: the model's
        # own, training over).
        self._last: tuple[Weights, list[np.ndarray] | None] | None = None
        self._copies: list[np.ndarray] = []
        self._lock = threading.Lock()  # the copy is written here and sent from the reader thread
        self._epoch: int | None = None  # the latest epoch shipped or kept

    def __call__(self, epoch: int) -> None:
        from ..model.spec import optimizer_layout, optimizer_state_variables, optimizer_steps
        from ..model.tensors import buffer_arrays

        self._epoch = epoch
        model = self.model
        # The torch modules' buffers as they are now, with the weights of this epoch (copies: sent later).
        head = Weights(epoch, optimizer_steps(model), optimizer_layout(model), buffers=buffer_arrays(model))
        if self.every_epoch:
            self._send(head, weights_and_optimizer(model)[0])
            return
        with self._lock:
            if epoch == self.final_epoch:
                self._last = (head, None)
                return
            kept = device_copies([*model.weights, *optimizer_state_variables(model)], self._copies)
            if kept is not None:  # on a GPU: kept there until sent
                self._copies = kept
                self._last = (head, kept)
                return
            weights = weights_and_optimizer(model)[0]
            if [(a.shape, a.dtype) for a in self._copies] != [(w.shape, w.dtype) for w in weights]:
                self._copies = [np.empty_like(w) for w in weights]
            for copy, w in zip(self._copies, weights):
                np.copyto(copy, w)
            self._last = (head, self._copies)

    def finish(self) -> None:
        """Training ended: send the last epoch's weights if they have not gone yet.

        With ``use_ema`` Keras' fit swaps the moving averages into the model after the last epoch
        (``finalize_variable_values``): those are the weights a local fit leaves, so they are taken again.
        """
        from ..model.spec import uses_ema

        if self._epoch is not None and uses_ema(self.model.optimizer):
            self._last = None
            every_epoch, self.every_epoch = self.every_epoch, True
            try:
                self(self._epoch)
            finally:
                self.every_epoch = every_epoch
            return
        self.on_stop()

    def on_stop(self) -> None:
        with self._lock:  # held while sending: the next epoch's copy waits (the worker exits after a stop)
            last, self._last = self._last, None
            if last is not None:
                head, weights = last
                state = [host_copy(w) for w in weights] if weights is not None else None
                self._send(head, state if state is not None else weights_and_optimizer(self.model)[0])

    def _send(self, head: Weights, state: list[np.ndarray]) -> None:
        """``head`` with the state: the model's weights (``get_weights()``'s), then the optimizers'."""
        n = len(self.model.weights)
        self.send(dataclasses.replace(head, weights=state[:n], optimizer=state[n:]))
        self.sent += 1
