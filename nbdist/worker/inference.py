"""Evaluation and prediction as a worker runs them: the notebook's model, run on the shard, report.

The compute (``evaluate_shard``, ``predict_shard``) takes arrays, not a connection,
so a backend whose shards come from elsewhere (Spark partitions) can feed it too.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any

import numpy as np

from ..data.structures import flatten_outputs, has_text, map_struct
from ..model.spec import overrides
from ..wire.messages import JobMessage
from ..wire.reports import Done, Evaluation, Predictions, Progress
from .datasets import sample_count, tf_structure, uses_tf_data

log = logging.getLogger("nbdist.worker")


def evaluate_shard(model: Any, x: Any, y: Any, batch_size: int, classifier: dict[str, Any] | None,
                   sample_weight: Any = None) -> tuple[list[str], list[np.ndarray], dict[str, Any]]:
    """Metric variables after evaluating this shard (``x``, ``y``, ``sample_weight`` as ``model.evaluate``
    takes them: arrays, or lists or dicts of arrays), plus the classifier's additive counts."""
    from ..model.metrics import ClassifierSpec, shard_statistics

    if overrides(model, "evaluate") and not uses_tf_data() and not hasattr(x, "element_spec"):
        # The class's own evaluate, as the notebook's call would run it: on the arrays (batches known in size on
        # JAX and torch either way, ``_unsized_batches``).
        model.evaluate(x, y, sample_weight=sample_weight, batch_size=batch_size, verbose=0)
    else:
        model.evaluate(_unsized_batches(x, y, sample_weight, batch_size), verbose=0)
    names = [v.path for v in model.metrics_variables]
    state = [np.asarray(v.numpy()) for v in model.metrics_variables]
    extra: dict[str, Any] = {}
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):  # one label row and its prediction (Spark's driver)
        extra["y_row"] = np.asarray(y[:1])
        extra["y_pred_row"] = np.asarray(_predict(model, x[:1], 1))
    spec = ClassifierSpec.from_json(classifier)
    if spec is not None:
        # A second pass for the predictions: model.evaluate does not hand them out.
        extra["stats"] = shard_statistics(y, _predict(model, x, batch_size), spec)
    return names, state, extra


def _unsized_batches(x: Any, y: Any, sample_weight: Any, batch_size: int) -> Any:
    """The shard in batches whose size the traced step does not know. Keras weighs each batch's
    per-output loss (``<output>_loss``) by the batch size when the trace knows it and by 1 otherwise:
    a worker whose batches are all full would weigh them by 64 and another by 1, and their merged
    state would be neither. With the size unknown every batch weighs 1, as in the notebook's evaluate.
    On JAX and torch (no TensorFlow needed) every traced batch knows its size, in the notebook's evaluate
    as on every worker, so numpy batches weigh alike everywhere."""
    if not uses_tf_data() and not hasattr(x, "element_spec"):
        parts = (x, y) if sample_weight is None else (x, y, sample_weight)
        rows = sample_count(x)
        return (tuple(map_struct(lambda a, i=i: a[i:i + batch_size], p) for p in parts)
                for i in range(0, rows, batch_size))
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):  # a memory-mapped file's batches: the labels and weights beside them
        rest = tuple(p for p in (y, sample_weight) if p is not None)
        labels = tf.data.Dataset.from_tensor_slices(tf_structure(rest)).batch(batch_size)
        return tf.data.Dataset.zip((x, labels)).map(lambda xb, rb: (xb, *rb))
    parts = tf_structure((x, y) if sample_weight is None else (x, y, sample_weight))
    return tf.data.Dataset.from_tensor_slices(parts).batch(batch_size)


def _predict(model: Any, x: Any, batch_size: int) -> Any:
    """``model.predict`` on the shard. Text (numpy str or bytes arrays) goes through tf.data, which takes
    it as tf.string; Keras' own array path refuses a str dtype ("Invalid dtype: str288")."""
    if not hasattr(x, "element_spec") and has_text(x) and uses_tf_data():
        import tensorflow as tf

        return model.predict(tf.data.Dataset.from_tensor_slices(tf_structure(x)).batch(batch_size), verbose=0)
    return model.predict(x, verbose=0, **_sized(x, batch_size))


def _sized(x: Any, batch_size: int) -> dict[str, int]:
    """``batch_size`` for ``predict`` on arrays; a dataset is already in batches."""
    return {} if hasattr(x, "element_spec") else {"batch_size": batch_size}


def file_features(data_file: dict[str, Any], batch_size: int) -> tuple[Any, int]:
    """This worker's rows of the notebook's memory-mapped .npy (local workers) as batches read from the
    file a block at a time, never the whole share in memory; and their count."""
    import tensorflow as tf

    from ..wire.shardfile import NpyRows
    from .streams import window_batches

    first = NpyRows(data_file, None)
    rows = first.rows
    row = first.block(0)[0][:0] if rows else np.zeros((0, *data_file["shape"][1:]), np.float32)
    first.close()

    def batches() -> Any:
        reader = NpyRows(data_file, None)
        try:
            blocks = ((reader.block(i)[0],) for i in range(reader.blocks))
            for (xb,) in window_batches(blocks, batch_size, batch_size, False, np.random.default_rng(0)):
                yield xb
        finally:
            reader.close()

    spec = tf.TensorSpec((None, *row.shape[1:]), tf.as_dtype(row.dtype))
    return tf.data.Dataset.from_generator(batches, output_signature=spec), rows


def predict_shard(model: Any, x: Any, batch_size: int) -> tuple[Any, list[np.ndarray]]:
    """The predictions as ``model.predict`` returns them, flattened: (their layout, the arrays)."""
    return _flat_predictions(_predict(model, x, batch_size))


def py_dataset_share(job: JobMessage) -> Any:
    """This worker's share of a notebook's PyDataset (batches rank, rank + world, ... in order), read by
    the training path's reader of validation shares (worker/pydatasets.py); None for other data."""
    if job.py_datasets is None:
        return None
    import cloudpickle  # only reached on an authenticated channel

    from .pydatasets import ValidationShare

    data = cloudpickle.loads(job.py_datasets)["inference"]
    return ValidationShare(data, cloudpickle.loads(data.payload), job.rank, job.world_size)


def _run_share(link: Any, job: JobMessage, model: Any, share: Any) -> int:
    """Evaluate or predict on this worker's PyDataset share, one pass in order; answer; its rows.

    The pass's batches keep their own sizes, unknown to the traced step (the reader's signature leaves the
    batch dimension open, as Keras' own PyDataset adapter does), so per-batch means merge as the local
    ``evaluate`` computes them. A worker with no batch (fewer batches than workers) answers with no rows."""
    if job.kind == "evaluate":
        if not share.count:
            link.send(Evaluation(rows=0))
            return 0
        model.evaluate(share.pipeline(), steps=share.count, verbose=0)
        state = [np.asarray(v.numpy()) for v in model.metrics_variables]
        # No label row: the driver builds its metric variables from the dataset's first row itself.
        link.send(Evaluation(share.last_pass_rows, [v.path for v in model.metrics_variables], state))
        return share.last_pass_rows
    layout, outputs = _flat_predictions(model.predict(share.pipeline(), steps=share.count, verbose=0)) \
        if share.count else (None, [])
    # Each batch's rows: the driver puts the workers' strided batches back in the dataset's order.
    link.send(Predictions(share.last_pass_rows, layout, outputs, list(share.last_pass_batch_rows)))
    return share.last_pass_rows


def _flat_predictions(out: Any) -> tuple[Any, list[np.ndarray]]:
    return flatten_outputs(out)


def _fit_input(model: Any, x: Any) -> Any:
    """Flat rows from Spark columns reshaped to an image model's input (e.g. 3072 -> 32x32x3)."""
    if not isinstance(x, np.ndarray):
        return x
    try:
        shape = tuple(model.inputs[0].shape[1:])
    except (AttributeError, IndexError, ValueError):
        return x
    if len(shape) > 1 and None not in shape and x.ndim == 2 and x.shape[1] == int(np.prod(shape)):
        return x.reshape((len(x), *shape))
    return x


def run_inference(link: Any, job: JobMessage) -> None:
    from ..model.spec import model_from_spec

    link.heartbeat_timeout = float(job.heartbeat_timeout)
    model = model_from_spec(job.model)
    x, y, batch_size = job.x, job.y, job.batch_size
    share = py_dataset_share(job)
    if share is not None:
        link.send(Progress(job.kind + "ing", epoch=0, batch=0, batches=share.count))
        started = time.perf_counter()
        rows = _run_share(link, job, model, share)
        link.send(Done(seconds=time.perf_counter() - started, tensorflow_loaded="tensorflow" in sys.modules))
        log.info("worker %d %s %d rows of a PyDataset in %.2f s", job.rank, job.kind, rows,
                 time.perf_counter() - started)
        return
    if job.data_source == "file":  # the notebook's memory map: read here, a block at a time
        x, rows = file_features(job.data_file, batch_size)
    else:
        rows = sample_count(x)
    link.send(Progress(job.kind + "ing", epoch=0, batch=0, batches=-(-rows // batch_size)))
    started = time.perf_counter()
    x = _fit_input(model, x)
    if job.kind == "evaluate" and rows == 0:  # an empty Spark partition: nothing to add
        link.send(Evaluation(rows=0))
    elif job.kind == "predict":
        layout, outputs = predict_shard(model, x, batch_size)
        link.send(Predictions(rows, layout, outputs))
    elif job.kind == "evaluate":
        names, state, extra = evaluate_shard(model, x, y, batch_size, job.classifier, job.sample_weight)
        stats = extra.get("stats") or {}
        link.send(Evaluation(rows, names, state, extra.get("y_row"), extra.get("y_pred_row"), stats.get("confusion"),
                             stats.get("histogram")))
    else:
        raise ValueError(f"unknown job kind {job.kind!r}")
    link.send(Done(seconds=time.perf_counter() - started, tensorflow_loaded="tensorflow" in sys.modules))
    log.info("worker %d %s %d rows in %.2f s", job.rank, job.kind, rows, time.perf_counter() - started)
