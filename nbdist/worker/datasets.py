"""The worker's input pipeline: one repeated tf.data pipeline per ``fit``, fed with steps_per_epoch.

Why: ``model.fit(x, y, batch_size=...)`` makes Keras build a new tf.data iterator at every epoch start, at
a cost proportional to the steps; given ONE infinite dataset and ``steps_per_epoch`` (and
``validation_steps``), Keras keeps one iterator for the whole fit. Invariant: the batches are exactly those
of ``fit(x, y, batch_size=b, shuffle=...)``: full batches, then the short one, one pass per epoch, a fresh
permutation every epoch with shuffle (the callbacks count them with ``strategies.averaging.batch_sizes``).
Memory: rows are never copied into a shuffle buffer: each epoch permutes an int64 index vector and every
batch gathers its rows from variables made once, and the worker drops the received arrays once the
variables hold them (``job_inputs``).
"""
from __future__ import annotations

import logging
import secrets
from typing import Any

import numpy as np

from ..data.sharding import batches_per_epoch
from ..data.structures import tf_structure
from ..wire.messages import JobMessage
from .tfdata import without_autotune
from .validation import whole_passes

log = logging.getLogger("nbdist.worker")


# -- pure helpers ------------------------------------------------------------
def epoch_steps(samples: int, batch_size: int) -> int:
    """Batches in one pass over ``samples`` rows: full batches plus the short last one.

    At least one sample: Keras treats ``steps_per_epoch=0`` as "until the data ends",
    which on a repeated dataset is never.
    """
    if samples < 1:
        raise ValueError(f"a worker needs at least one sample to train on, got {samples}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return batches_per_epoch(samples, batch_size)


def fit_steps(samples: int, val_samples: int, batch_size: int) -> tuple[int, int | None]:
    """(steps_per_epoch, validation_steps or None when there is no validation data)."""
    return epoch_steps(samples, batch_size), (epoch_steps(val_samples, batch_size) if val_samples else None)


def shuffle_seed(seed: int | None, rank: int) -> int:
    """The base of every epoch's permutation seed: ``seed + rank`` (the worker's Keras seed), else random."""
    if seed is None:
        return secrets.randbits(62)
    return int(seed) + int(rank)


def rank_batch_size(job: JobMessage) -> int:
    """This worker's batch: its share of the global batch of an intercepted ``fit``, else --batch-size."""
    sizes = job.train.batch_sizes
    return int(sizes[job.rank]) if sizes else int(job.batch_size)


def sample_count(x: Any) -> int:
    """Rows in ``x``: an array, or a list/tuple/dict of arrays with the same number of rows (a None
    among them is an optional input left out, as Keras takes it)."""
    if isinstance(x, (dict, list, tuple)):
        counts = [sample_count(v) for v in (x.values() if isinstance(x, dict) else x) if v is not None]
        return counts[0] if counts else 0
    return int(x.shape[0])


def uses_tf_data() -> bool:
    """Whether this worker feeds Keras through tf.data: on the TensorFlow backend only. A JAX or torch
    worker never imports TensorFlow (its import alone is seconds of CPU); it reads numpy batches."""
    import keras

    return keras.backend.backend() == "tensorflow"


# -- the pipeline (numpy: the JAX and torch backends) ----------------------------
def _take(struct: Any, rows: Any) -> Any:
    """``struct``'s rows ``rows`` (a slice or an index array), nested as it is."""
    if isinstance(struct, dict):
        return {k: _take(v, rows) for k, v in struct.items()}
    if isinstance(struct, (list, tuple)):
        return type(struct)(_take(v, rows) for v in struct)
    return None if struct is None else struct[rows]  # an optional input given as None stays None


def numpy_batches(x: Any, y: Any, batch_size: int, shuffle: bool, seed: int = 0, first_epoch: int = 0,
                  sample_weight: Any = None) -> Any:
    """``repeated_batches`` as an infinite generator of numpy batches: the same batches (full ones, then the
    short one, one pass per epoch); a shuffled epoch ``e`` is permuted by numpy seeded ``(seed, e)``."""
    n = sample_count(x)
    parts = (x,) if y is None else (x, y) if sample_weight is None else (x, y, sample_weight)
    epoch = first_epoch
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else None
        for start in range(0, n, batch_size):
            rows = slice(start, min(start + batch_size, n)) if order is None else order[start:start + batch_size]
            batch = tuple(_take(p, rows) for p in parts)
            yield batch[0] if y is None else batch
        epoch += 1


# -- the pipeline (TensorFlow) -------------------------------------------------
def repeated_batches(x: Any, y: Any, batch_size: int, shuffle: bool, seed: int = 0,
                     first_epoch: int = 0, sample_weight: Any = None) -> Any:
    """An infinite tf.data.Dataset of ``(x, y)`` batches (``x`` alone when ``y`` is None, ``(x, y, w)``
    with sample weights), epoch after epoch. ``x``, ``y`` and ``w`` may be nested (dicts, lists).

    With ``shuffle``, epoch ``e`` is permuted by a stateless shuffle seeded ``(seed, e)``, counted
    from ``first_epoch``: a run resumed at epoch e sees the order the uninterrupted run would have.
    """
    import tensorflow as tf

    n = sample_count(x)
    full, rest = divmod(n, batch_size)
    # Held in variables, made once; tf.gather reads batches from them. A plain tensor captured
    # by the map function would be copied into the dataset's graph: one more copy of the shard.
    parts = tf_structure(x if y is None else (x, y) if sample_weight is None else (x, y, sample_weight))
    data = tf.nest.map_structure(resident, parts)  # an optional input given as None stays None
    base = tf.constant(seed, dtype=tf.int64)

    def order(epoch: Any) -> Any:
        indices = tf.range(n, dtype=tf.int64)
        if shuffle:
            indices = tf.random.experimental.stateless_shuffle(indices, seed=tf.stack([base, epoch]))
        return indices

    def batches(indices: Any) -> Any:
        # Full batches as rows of one reshaped tensor, then the short batch: Keras' own layout.
        ds = tf.data.Dataset.from_tensor_slices(tf.reshape(indices[:full * batch_size], [full, batch_size]))
        if rest:
            ds = ds.concatenate(tf.data.Dataset.from_tensors(indices[full * batch_size:]))
        return ds

    def gather(indices: Any) -> Any:
        return tf.nest.map_structure(lambda t: None if t is None else tf.gather(t, indices), data)

    epochs = tf.data.Dataset.counter(start=first_epoch, dtype=tf.int64)
    return without_autotune(epochs.map(order).flat_map(batches).map(gather).prefetch(2))


def validation_batches(x: Any, y: Any, batch_size: int, sample_weight: Any = None) -> Any:
    """The validation shard in order, in batches of ``batch_size``, repeated: a pipeline without functions.

    Keras makes a new iterator over the validation data at every epoch (``evaluate`` resets it),
    and an iterator over ``repeated_batches`` instantiates its map functions each time: measured
    here 60 ms per epoch for 225 digits, against 0.9 ms for slices and a batch, with one copy
    of the shard either way (an eager tensor, which the dataset holds by reference).
    """
    import tensorflow as tf

    parts = tf_structure(x if y is None else (x, y) if sample_weight is None else (x, y, sample_weight))
    as_tensor = lambda a: a if a is None or isinstance(a, tf.RaggedTensor) else tf.convert_to_tensor(a)
    data = tf.nest.map_structure(as_tensor, parts)
    return whole_passes(without_autotune(tf.data.Dataset.from_tensor_slices(data).batch(batch_size).repeat()))


def validation_inputs(validation: tuple[Any, ...], batch_size: int, val_steps: int) -> dict[str, Any]:
    """``fit``'s validation arguments: the repeated pipeline on TensorFlow; on JAX and torch the arrays
    themselves, read in order in batches of ``batch_size`` (Keras keeps their iterator across epochs)."""
    if uses_tf_data():
        return {"validation_data": validation_batches(validation[0], validation[1], batch_size,
                                                      validation[2] if len(validation) > 2 else None),
                "validation_steps": val_steps}
    data = tuple(v for v in validation if v is not None) if len(validation) > 2 else tuple(validation[:2])
    return {"validation_data": data, "validation_batch_size": batch_size, "validation_steps": val_steps}


def stream_batches(stream: Any) -> Any:
    """A streamed share's batches as numpy, for the JAX and torch backends: ``(x, y)``, or ``x`` alone."""
    labelled = stream.signature[1] is not None
    for batch in stream():
        yield tuple(batch) if labelled else batch[0]


def resident(array: Any) -> Any:
    """``array`` as a non-trainable variable: one copy, which ``tf.data`` reads by reference (None, an
    optional input left out, as it is). A tf.RaggedTensor as it is: a variable holds no ragged value, and
    ``tf.gather`` takes its rows as an array's."""
    import tensorflow as tf

    if array is None or isinstance(array, tf.RaggedTensor):
        return array
    return tf.Variable(array, trainable=False, name="nbdist_shard")


def fit_inputs(x: Any, y: Any, batch_size: int, shuffle: bool, seed: int | None, rank: int,
               first_epoch: int, validation: tuple[Any, ...] | None, sample_weight: Any = None) -> dict[str, Any]:
    """Keyword arguments for ``model.fit`` (data, steps_per_epoch and validation), built once per fit."""
    val_samples = sample_count(validation[0]) if validation is not None else 0
    steps, val_steps = fit_steps(sample_count(x), val_samples, batch_size)
    batches = repeated_batches if uses_tf_data() else numpy_batches
    kwargs: dict[str, Any] = {
        "x": batches(x, y, batch_size, shuffle, shuffle_seed(seed, rank), first_epoch, sample_weight),
        "steps_per_epoch": steps,
        "shuffle": False,  # the pipeline shuffles; Keras would only warn that it ignores the flag
    }
    if val_steps is not None:
        kwargs.update(validation_inputs(validation, batch_size, val_steps))
    log.debug("input pipeline: %d steps per epoch, %s validation steps", steps, val_steps)
    return kwargs


def streamed_inputs(job: JobMessage, validation: tuple[Any, ...] | None) -> tuple[dict[str, Any], int, int]:
    """``fit`` arguments streaming the share the Spark task wrote next to this worker, or its rows of the
    notebook's memory-mapped .npy (streams.py); its row and validation row counts. Validation data that
    comes over the wire is held as for arrays; a task's share of a validation DataFrame is streamed too."""
    from ..wire.shardfile import NpyRows, ShardReader
    from .streams import ShardStream, streamed_batches

    train = job.train
    reader = NpyRows(job.data_file, job.y) if job.data_source == "file" else ShardReader()
    batch_size = rank_batch_size(job)
    val_reader = ShardReader(validation_dir()) if train.validation_on_tasks else None
    val_samples = val_reader.rows if val_reader is not None else \
        sample_count(validation[0]) if validation is not None else 0
    steps, val_steps = fit_steps(reader.rows, val_samples, batch_size)
    stream = ShardStream(reader, batch_size, bool(train.shuffle), shuffle_seed(train.seed, job.rank),
                         first_pass(job), int(train.stream_buffer_bytes))
    batches = streamed_batches(stream) if uses_tf_data() else stream_batches(stream)
    kwargs: dict[str, Any] = {"x": batches, "steps_per_epoch": steps, "shuffle": False}
    if val_steps is not None and val_reader is not None:
        kwargs.update(streamed_validation(val_reader, batch_size, val_steps, int(train.stream_buffer_bytes)))
    elif val_steps is not None:
        kwargs.update(validation_inputs(validation, batch_size, val_steps))
    log.info("streaming %d rows in %d blocks from %s (a shuffle window of %d rows)%s", reader.rows, reader.blocks,
             reader.path, stream.window, f", and {val_samples} validation rows" if val_reader is not None else "")
    return kwargs, reader.rows, val_samples


def validation_dir() -> str:
    """Where this worker's task wrote its share of a validation DataFrame (spark/task.py)."""
    import os

    from ..wire.shardfile import DATA_ENV, VALIDATION_DIR

    return os.path.join(os.environ.get(DATA_ENV, ""), VALIDATION_DIR)


def streamed_validation(reader: Any, batch_size: int, val_steps: int, buffer_bytes: int) -> dict[str, Any]:
    """``fit``'s validation arguments streaming a task's validation share: in order, a whole pass per
    validation (``val_steps`` batches, the short one last), read block by block like the training share."""
    from .streams import ShardStream, streamed_batches

    stream = ShardStream(reader, batch_size, False, 0, 0, buffer_bytes)
    batches = streamed_batches(stream) if uses_tf_data() else stream_batches(stream)
    return {"validation_data": whole_passes(batches), "validation_steps": val_steps}


def job_inputs(job: JobMessage) -> tuple[dict[str, Any], int, int]:
    """``fit_inputs`` for a worker's job, with its training and validation sample counts.

    The job's numpy shard is dropped once the pipeline holds its own copy: keeping both would
    double the worker's memory for the data. A Spark task's shard is streamed from its file.
    """
    train = job.train
    if job.data_source in ("task", "file"):
        validation = None
        if job.x_val is not None and sample_count(job.x_val) > 0:
            validation = (job.x_val, job.y_val, job.sample_weight_val)
        inputs, samples, val_samples = streamed_inputs(job, validation)
        job.y = job.x_val = job.y_val = job.sample_weight_val = None
        return inputs, epoch_window(job, inputs, samples), val_samples
    validation = None
    if job.x_val is not None and sample_count(job.x_val) > 0:
        validation = (job.x_val, job.y_val, job.sample_weight_val)
    samples = sample_count(job.x)
    val_samples = sample_count(validation[0]) if validation is not None else 0
    inputs = fit_inputs(job.x, job.y, rank_batch_size(job), bool(train.shuffle), train.seed, job.rank,
                        first_pass(job), validation, job.sample_weight)
    job.x = job.y = job.sample_weight = job.x_val = job.y_val = job.sample_weight_val = None
    return inputs, epoch_window(job, inputs, samples), val_samples


def first_pass(job: JobMessage) -> int:
    """The pass over the shard the pipeline starts with (its shuffle seed): the first epoch's, unless
    fit's steps_per_epoch makes epochs shorter than a pass (the driver counts them)."""
    return int(job.train.first_pass if job.train.steps_per_epoch else job.train.initial_epoch)


def epoch_window(job: JobMessage, inputs: dict[str, Any], samples: int) -> int:
    """fit's ``steps_per_epoch``: every epoch reads that many full batches of the repeated pipeline where
    the last stopped, as Keras reads in-memory data (the driver checked that every epoch is alike);
    returns the samples of an epoch (``samples``, one pass, without it)."""
    steps = job.train.steps_per_epoch
    if not steps:
        return samples
    inputs["steps_per_epoch"] = int(steps)
    if job.train.first_batch:  # a relaunch continues the pass where the failed run's epoch began
        inputs["x"] = inputs["x"].skip(int(job.train.first_batch))
    return int(steps) * rank_batch_size(job)
