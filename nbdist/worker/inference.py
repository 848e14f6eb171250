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

from ..wire.messages import JobMessage, MessageType

log = logging.getLogger("nbdist.worker")


def evaluate_shard(model: Any, x: np.ndarray, y: np.ndarray, batch_size: int,
                   classifier: dict[str, Any] | None) -> tuple[list[str], list[np.ndarray], dict[str, Any]]:
    """Metric variables after evaluating this shard, plus the classifier's additive counts."""
    from ..metrics import ClassifierSpec, shard_statistics

    model.evaluate(x, y, batch_size=batch_size, verbose=0)
    names = [v.path for v in model.metrics_variables]
    state = [np.asarray(v.numpy()) for v in model.metrics_variables]
    y_pred_row = model.predict(x[:1], batch_size=1, verbose=0)
    extra: dict[str, Any] = {"y_row": np.asarray(y[:1]), "y_pred_row": np.asarray(y_pred_row)}
    spec = ClassifierSpec.from_json(classifier)
    if spec is not None:
        # A second pass for the predictions: model.evaluate does not hand them out.
        extra["stats"] = shard_statistics(y, model.predict(x, batch_size=batch_size, verbose=0), spec)
    return names, state, extra


def predict_shard(model: Any, x: np.ndarray, batch_size: int) -> list[np.ndarray]:
    out = model.predict(x, batch_size=batch_size, verbose=0)
    return [np.asarray(a) for a in (out if isinstance(out, (list, tuple)) else [out])]


def _fit_input(model: Any, x: np.ndarray) -> np.ndarray:
    """Flat rows from Spark columns reshaped to an image model's input (e.g. 3072 -> 32x32x3)."""
    try:
        shape = tuple(model.inputs[0].shape[1:])
    except (AttributeError, IndexError, ValueError):
        return x
    if len(shape) > 1 and None not in shape and x.ndim == 2 and x.shape[1] == int(np.prod(shape)):
        return x.reshape((len(x), *shape))
    return x


def run_inference(link: Any, job: JobMessage) -> None:
    from ..model_io import model_from_spec
    from .runtime import pin_threads

    link.heartbeat_timeout = float(job.heartbeat_timeout)
    pin_threads(job.threads)
    model = model_from_spec(job.model)
    x, y, batch_size = job.x, job.y, job.batch_size
    link.send({"type": MessageType.PROGRESS, "state": job.kind + "ing", "epoch": 0, "batch": 0,
               "batches": -(-len(x) // batch_size)})
    started = time.perf_counter()
    x = _fit_input(model, x)
    if job.kind == "evaluate" and len(x) == 0:  # an empty Spark partition: nothing to add
        link.send({"type": MessageType.EVALUATION, "rows": 0, "names": [], "has_stats": False,
                   "has_histogram": False})
    elif job.kind == "predict":
        outputs = predict_shard(model, x, batch_size)
        link.send({"type": MessageType.PREDICTIONS, "rows": len(x)}, outputs)
    elif job.kind == "evaluate":
        names, state, extra = evaluate_shard(model, x, y, batch_size, job.classifier)
        stats = extra.get("stats")
        arrays = state + [extra["y_row"], extra["y_pred_row"]]
        if stats is not None:
            arrays.append(stats["confusion"])
            if "histogram" in stats:
                arrays.append(stats["histogram"])
        link.send({"type": MessageType.EVALUATION, "rows": len(x), "names": names,
                   "has_stats": stats is not None, "has_histogram": bool(stats and "histogram" in stats)},
                  arrays)
    else:
        raise ValueError(f"unknown job kind {job.kind!r}")
    link.send({"type": MessageType.DONE, "seconds": time.perf_counter() - started,
               "tensorflow_loaded": "tensorflow" in sys.modules})
    log.info("worker %d %s %d rows in %.2f s", job.rank, job.kind, len(x), time.perf_counter() - started)
