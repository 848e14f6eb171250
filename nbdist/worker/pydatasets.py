"""A notebook's ``keras.utils.PyDataset`` on a worker: this worker's share of its batches.

A distributed batch is the PyDataset's own batch: worker ``rank`` of ``world`` reads the batch indices
``order[rank::world]`` of every epoch (``data.sharding.share_indices``), ``order`` being ``range(len(ds))``,
shuffled by (job seed, epoch) when ``shuffle=True`` as Keras shuffles a PyDataset's batch order; so one step
of all workers reads ``world`` consecutive batches, an unshuffled epoch keeps its order and shares differ by
at most one batch. Rows per batch are known only once read, so ``ShareReader`` reads the share ahead in a
thread (a few batches) and before each step the workers sum their rows (``ShareAllreduceCallback``); a
shorter share joins the last step with zero rows, so every worker takes the same steps. Averaging weights
each worker by the rows it read. Validation (``ValidationShare``) is one self-contained pass per epoch.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from ..data.inputs import PyDatasetData, batch_rows, standardize_batch
from ..data.sharding import epoch_hook, epoch_order, epoch_window, share_count, share_indices
from ..strategies.allreduce_hook import AllreduceCallback
from ..strategies.averaging import synced_state
from ..wire.messages import JobMessage
from .datasets import tf_structure, uses_tf_data
from .readahead import put_until_stopped
from .tfdata import without_autotune
from .validation import whole_passes

log = logging.getLogger("nbdist.worker")

PEEK = 3  # batches read up front to fix the pipeline's signature (as Keras peeks at a PyDataset)
AHEAD = 4  # batches read ahead of training at most


def signature(batches: Sequence[Any]) -> Any:
    """tf.TensorSpecs for the batches: the batch dimension open, other dimensions open where they differ."""
    import tensorflow as tf

    def spec(*arrays: np.ndarray) -> Any:
        first = arrays[0]
        shape = [None] + [d if all(a.shape[i + 1] == d for a in arrays) else None
                          for i, d in enumerate(first.shape[1:])]
        return tf.TensorSpec(shape, tf.as_dtype(first.dtype))

    return tf.nest.map_structure(spec, *batches)


class ShareReader:
    """Reads this worker's share of the training batches epoch after epoch, ahead of training, in a thread."""

    def __init__(self, data: PyDatasetData, dataset: Any, rank: int, world: int, shuffle: bool, seed: int,
                 first_epoch: int, timeout: float = 600.0, window: tuple[int | None, int, int] = (None, 0, 0)) -> None:
        """``window``: fit's (steps_per_epoch, first pass, first batch), as the driver set them (``epoch_window``)."""
        self.data, self.dataset = data, dataset
        self.rank, self.world, self.shuffle, self.seed = rank, world, shuffle, seed
        self.window = window
        self.epoch_batches = window[0] or data.batches  # the batches all workers read in an epoch
        self.count = share_count(self.epoch_batches, rank, world)
        self.first_epoch = first_epoch
        self.timeout = timeout
        self.epoch = first_epoch  # the epoch training is in (set by ShareEpochCallback)
        self._rows: dict[tuple[int, int], int] = {}
        self._cond = threading.Condition()
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=AHEAD)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        epoch_hook(self.dataset.on_epoch_begin, seed, first_epoch)
        indices = self.indices(first_epoch)
        self._peeked = [self._read(first_epoch, j, i) for j, i in enumerate(indices[:PEEK])]
        self.signature = signature(self._peeked) if uses_tf_data() else None
        self._thread = threading.Thread(target=self._run, name="nbdist-pydataset", daemon=True)
        self._thread.start()

    def indices(self, epoch: int) -> np.ndarray:
        """This worker's batch indices of ``epoch``: its share of the epoch's part of a pass, the pass's order
        shuffled by (seed, pass) when ``shuffle``."""
        steps, first_pass, first_batch = self.window
        at, a, b = epoch_window(self.data.batches, steps, first_pass, first_batch, epoch - self.first_epoch)
        if not steps:
            at = epoch
        return share_indices(epoch_order(self.data.batches, self.shuffle, self.seed, at)[a:b], self.rank, self.world)

    def _read(self, epoch: int, j: int, index: int) -> Any:
        batch = tf_structure(standardize_batch(self.dataset[int(index)], self.data.class_weight))
        with self._cond:
            self._rows[(epoch, j)] = batch_rows(batch)
            self._cond.notify_all()
        return batch

    def _put(self, item: Any) -> bool:
        return put_until_stopped(self._queue, item, self._stop)

    def _run(self) -> None:
        epoch = self.first_epoch
        try:
            while True:
                for j, index in enumerate(self.indices(epoch)):
                    batch = self._peeked.pop(0) if self._peeked else self._read(epoch, j, index)
                    if not self._put(batch):
                        return
                epoch_hook(self.dataset.on_epoch_end, self.seed, epoch)
                epoch += 1
                epoch_hook(self.dataset.on_epoch_begin, self.seed, epoch)
        except BaseException as exc:  # the notebook's __getitem__ raised: training ends with its error
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            self._put(exc)

    def batches(self) -> Iterator[Any]:
        while True:
            item = self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def rows(self, epoch: int, j: int) -> int:
        """Rows of batch ``j`` of ``epoch`` in this share, waiting until the reader has read it."""
        with self._cond:
            if not self._cond.wait_for(lambda: (epoch, j) in self._rows or self._error is not None,
                                       timeout=self.timeout):
                raise TimeoutError(f"the PyDataset's batch {j} of epoch {epoch + 1} was not read within "
                                   f"{self.timeout:.0f} s")
            if (epoch, j) not in self._rows:
                raise self._error  # what the dataset raised, as Keras' fit would raise it
            return self._rows[(epoch, j)]

    def epoch_rows(self, epoch: int) -> int:
        return sum(self.rows(epoch, j) for j in range(self.count))

    def forget_before(self, epoch: int) -> None:
        with self._cond:
            for key in [k for k in self._rows if k[0] < epoch]:
                del self._rows[key]

    def close(self) -> None:
        self._stop.set()

    def pipeline(self) -> Any:
        """tf.data on TensorFlow; on JAX and torch the numpy batches themselves (no TensorFlow import)."""
        if not uses_tf_data():
            return self.batches()
        import tensorflow as tf

        return without_autotune(tf.data.Dataset.from_generator(self.batches, output_signature=self.signature)
                                .prefetch(2))


class ValidationShare:
    """This worker's share of a validation PyDataset, in order: one self-contained pass per iterator.
    Evaluation and prediction on a PyDataset (worker/inference.py) read their share through it too."""

    def __init__(self, data: PyDatasetData, dataset: Any, rank: int, world: int, seed: int = 0) -> None:
        self.data, self.dataset, self.seed = data, dataset, seed
        self.indices = share_indices(epoch_order(data.batches, False, 0, 0), rank, world)
        self.count = len(self.indices)
        self.last_pass_rows = 0
        self.last_pass_batch_rows: list[int] = []  # rows of each batch of the last pass (prediction's order)
        self._passes = 0
        epoch_hook(self.dataset.on_epoch_begin, seed, 0)
        self._peeked = [tf_structure(standardize_batch(dataset[int(i)])) for i in self.indices[:PEEK]]
        self.signature = signature(self._peeked) if self._peeked and uses_tf_data() else None

    def passes(self) -> Iterator[Any]:
        if self._passes:
            epoch_hook(self.dataset.on_epoch_end, self.seed, self._passes - 1)
            epoch_hook(self.dataset.on_epoch_begin, self.seed, self._passes)
        self._passes += 1
        peeked, self._peeked = self._peeked, []  # the first pass reuses the batches read for the signature
        rows = 0
        self.last_pass_batch_rows = []
        for j, index in enumerate(self.indices):
            batch = peeked[j] if j < len(peeked) else tf_structure(standardize_batch(self.dataset[int(index)]))
            rows += batch_rows(batch)
            self.last_pass_rows = rows
            self.last_pass_batch_rows.append(batch_rows(batch))
            yield batch

    def endless(self) -> Iterator[Any]:
        while True:
            yield from self.passes()

    def pipeline(self) -> Any:
        """tf.data (one pass per iterator) on TensorFlow; on JAX and torch one generator of all passes in
        turn, ``count`` batches each, read through one kept iterator (validation.py)."""
        if not uses_tf_data():
            return whole_passes(self.endless())  # read through one kept iterator (validation.py)
        import tensorflow as tf

        return tf.data.Dataset.from_generator(self.passes, output_signature=self.signature)


class ShareSizes(Sequence[int]):
    """Rows of each batch of the current epoch's share, for callbacks that count rows per batch."""

    def __init__(self, reader: ShareReader) -> None:
        self.reader = reader

    def __len__(self) -> int:
        return self.reader.count

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[i] for i in range(*j.indices(len(self)))]
        if not 0 <= j < len(self):
            raise IndexError(j)
        return self.reader.rows(self.reader.epoch, j)


class ShareEpochCallback(keras.callbacks.Callback):
    """Tells the reader which epoch training is in, and the event stream the rows each epoch had."""

    def __init__(self, feed: Feed) -> None:
        super().__init__()
        self.feed = feed
        self.event: Any = None  # the EventCallback whose samples / val_samples are set each epoch

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self.feed.train is not None:
            self.feed.train.epoch = epoch
            self.feed.train.forget_before(epoch - 1)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.event is None:
            return
        if self.feed.train is not None:
            self.event.samples = self.feed.train.epoch_rows(epoch)
        if self.feed.validation is not None:
            self.event.val_samples = self.feed.validation.last_pass_rows


@dataclass
class Feed:
    """``model.fit``'s data keyword arguments for a job with a PyDataset (training, validation or both)."""

    inputs: dict[str, Any]
    samples: int  # training rows per epoch (an estimate until the first epoch is read)
    val_samples: int
    train: ShareReader | None = None
    validation: ValidationShare | None = None
    tracker: ShareEpochCallback | None = field(default=None, repr=False)

    @property
    def sizes(self) -> ShareSizes | None:
        return ShareSizes(self.train) if self.train is not None else None

    def callbacks(self, event: Any) -> list[Any]:
        """To go first in fit's callbacks: the epoch tracker, feeding ``event`` the rows seen."""
        self.tracker = ShareEpochCallback(self)
        self.tracker.event = event
        return [self.tracker]

    def close(self) -> None:
        if self.train is not None:
            self.train.close()


def job_feed(job: JobMessage, batch_size: int) -> Feed | None:
    """The job's data as fit's keyword arguments when it carries a PyDataset; None otherwise.

    ``batch_size`` is this worker's batch for arrays beside a PyDataset (e.g. array validation data).
    """
    if job.py_datasets is None:
        return None
    import cloudpickle  # only reached on an authenticated channel

    from .datasets import epoch_steps, fit_inputs, sample_count, validation_batches

    spec = cloudpickle.loads(job.py_datasets)
    train_data, val_data = spec["train"], spec["validation"]
    rank, world, settings = job.rank, job.world_size, job.train
    feed = Feed({}, 0, 0)
    if train_data is not None:
        reader = ShareReader(train_data, cloudpickle.loads(train_data.payload), rank, world, bool(settings.shuffle),
                             int(spec["order_seed"]), int(settings.initial_epoch), float(settings.sync_timeout),
                             (settings.steps_per_epoch, int(settings.first_pass), int(settings.first_batch)))
        feed.train = reader
        feed.samples = sum(reader.rows(reader.first_epoch, j) for j in range(min(PEEK, reader.count)))
        feed.samples += max(0, reader.count - PEEK) * train_data.first_rows
        feed.inputs = {"x": reader.pipeline(), "steps_per_epoch": reader.count, "shuffle": False}
    else:
        feed.inputs = fit_inputs(job.x, job.y, batch_size, bool(settings.shuffle), settings.seed, rank,
                                 int(settings.initial_epoch), None, job.sample_weight)
        feed.samples = sample_count(job.x)
        job.x = job.y = job.sample_weight = None
    if val_data is not None:
        share = ValidationShare(val_data, cloudpickle.loads(val_data.payload), rank, world, int(spec["order_seed"]) + 1)
        if share.count:  # fewer validation batches than workers: this one joins the metric sums with zeros
            feed.validation = share
            feed.inputs["validation_data"] = share.pipeline()
            feed.inputs["validation_steps"] = share.count
            feed.val_samples = share.count * val_data.first_rows
    elif job.x_val is not None and sample_count(job.x_val) > 0:
        feed.val_samples = sample_count(job.x_val)
        feed.inputs["validation_data"] = validation_batches(job.x_val, job.y_val, batch_size, job.sample_weight_val)
        feed.inputs["validation_steps"] = epoch_steps(feed.val_samples, batch_size)
        job.x_val = job.y_val = job.sample_weight_val = None
    log.info("PyDataset share: %s training batches, %s validation batches per epoch",
             feed.train.count if feed.train else "-", feed.validation.count if feed.validation else "-")
    return feed


class ShareAllreduceCallback(AllreduceCallback):
    """The allreduce's per-step weights for a PyDataset share: rows known only once read.

    Before each step the worker's rows are summed with every worker's (one scalar allreduce), so the
    gradients are weighted by rows over the step's total as for arrays; a shorter share pads.
    """

    def __init__(self, reducer: Any, apply: Any, trainable: Sequence[Any], reader: ShareReader, steps: int,
                 non_trainable: Any, collective: Any) -> None:
        super().__init__(reducer, apply, trainable, reader.count, 1, steps, non_trainable, None)
        self.reader = reader
        self.collective = collective
        self._epoch = reader.first_epoch

    def _total(self, rows: int) -> float:
        counts = np.array([float(rows)], dtype=np.float64)
        self.collective.allreduce_sum(counts)
        return float(counts[0])

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        rows = self.reader.rows(self._epoch, batch)
        self.reducer.set_weight(rows, self._total(rows))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch != self.reader.count - 1:
            return
        if self.steps_per_epoch > self.reader.count or self.non_trainable is not None:
            synced_state(self.model)  # JAX: pad steps and the statistics' average act on the variables
        for _ in range(self.reader.count, self.steps_per_epoch):
            self.reducer.pad_step(lambda grads: self._apply(grads, self._trainable), self._total(0))
            self.padded_steps += 1
        if self.non_trainable is not None:  # BatchNorm statistics: averaged, weighted by the rows read
            self.non_trainable.average(self.reader.epoch_rows(self._epoch))


__all__ = ["Feed", "ShareAllreduceCallback", "ShareReader", "ValidationShare", "job_feed"]
