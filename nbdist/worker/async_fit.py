"""``--strategy async`` as a worker runs it: blocks of K local steps against the driver's shared model.

The rule and its justification are in strategies/async_sgd.py. Each block: the driver's reply gives the
shared weights, their version and the next batch indices of the epoch (the driver deals them, so a fast
worker takes more); the worker trains them with ``train_on_batch`` (its own optimizer state), sends the
difference of its weights from the shared ones it started from, and waits for the next reply, never for
another worker. An empty block with ``epoch_done`` ends the epoch on the shared weights: validation
runs on them and the epoch's metrics (its own batches' running means) go to the driver as for the
other strategies. Every wait has the run's ``sync_timeout``.
"""
from __future__ import annotations

import logging
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..data.inputs import batch_rows
from ..fit_arguments import validates
from ..model.spec import keras_own
from ..wire.commands import AsyncShared, Decision
from ..wire.messages import JobMessage
from ..wire.reports import AsyncPull, AsyncPush, Epoch, Progress

log = logging.getLogger("nbdist.worker")


def _exchanged(model: Any) -> list[Any]:
    """The variables the shared model holds: the model's float weights (trainable or not), in order."""
    return [w for w in model.weights if "float" in str(w.dtype)]


def _read(variables: list[Any]) -> list[np.ndarray]:
    import keras

    return [np.asarray(keras.ops.convert_to_numpy(v.value), dtype=np.float32) for v in variables]


def fit_async(link: Any, job: JobMessage, model: Any) -> dict[str, Any]:
    """Train every epoch as the driver deals it; returns the closing report's additions."""
    from .async_batches import job_batches

    data = job_batches(job)  # a PyDataset's batches, or batches of the arrays this worker holds whole
    timeout = float(job.train.sync_timeout)
    variables = _exchanged(model)
    reader = ThreadPoolExecutor(1, thread_name_prefix="nbdist-async-read")
    try:
        return _epochs(link, job, model, data, variables, reader, timeout)
    finally:
        reader.shutdown(wait=False, cancel_futures=True)


def _epochs(link: Any, job: JobMessage, model: Any, data: Any, variables: list[Any], reader: Any,
            timeout: float) -> dict[str, Any]:
    import keras

    from .callbacks import metric_directions, split_logs
    from .fit_sync import apply_decision

    train = job.train
    first = True  # the first pull carries the model's weights as the job made them: the shared model's start
    every = [np.asarray(keras.ops.convert_to_numpy(w.value)) for w in model.weights]
    seq, pushed, refused = 0, 0, 0
    waited = validating = reading = 0.0  # seconds, for the closing report
    for epoch in range(int(train.initial_epoch), int(train.epochs)):
        started = time.perf_counter()
        model.reset_metrics()
        logs: dict[str, float] = {}
        samples = 0
        data.on_epoch_begin(epoch)
        link.send(Progress("training", epoch, 0, len(data), 0))
        link.send(AsyncPull(epoch, first, every if first else []))
        first, every = False, []
        reply = link.expect(AsyncShared, timeout)
        while True:
            _assign(variables, reply.weights)
            if reply.epoch_done:
                break
            base, rows = reply.weights, 0
            # Read ahead on one thread: the next batch is read while this one trains, as fit's reader does.
            reads = [reader.submit(data.batch, int(i)) for i in reply.batches]
            for read in reads:
                t0 = time.perf_counter()
                batch = read.result(timeout=timeout)
                reading += time.perf_counter() - t0
                x, y, w = (*batch, None, None)[:3]
                logs = keras_own(model, "train_on_batch")(x, y, sample_weight=w, return_dict=True)
                rows += batch_rows(batch)
            samples += rows
            delta = [now - before for now, before in zip(_read(variables), base)]
            link.send(AsyncPush(seq, reply.version, rows, epoch, delta))
            seq += 1
            t0 = time.perf_counter()
            reply = link.expect(AsyncShared, timeout)
            waited += time.perf_counter() - t0
            if reply.refused:
                refused += 1
                log.warning("the driver refused block %d: %s", seq - 1, reply.refused)
            else:
                pushed += 1
        data.on_epoch_end()
        logs = dict(logs)
        val_samples = 0
        t0 = time.perf_counter()
        if job.x_val is not None and validates(epoch, int(train.validation_freq or 1)):
            val_samples = batch_rows((job.x_val,))
            logs.update(_validate(model, job, val_samples))
        validating += time.perf_counter() - t0
        scalars, results = split_logs(logs)  # an array result (F1Score per class) travels as an array
        link.send(Epoch(epoch, scalars, samples, val_samples, time.perf_counter() - started,
                        array_names=list(results), array_logs=list(results.values()),
                        directions=metric_directions(model)))
        if train.epoch_decisions:
            apply_decision(model, link.expect(Decision, timeout))
        if getattr(model, "stop_training", False):
            break
    return {"async_pushed": pushed, "async_refused": refused, "async_wait_seconds": waited,
            "async_read_seconds": reading, "validation_seconds": validating,
            "keras_backend": keras.backend.backend(), "tensorflow_loaded": "tensorflow" in sys.modules}


def _assign(variables: list[Any], arrays: list[np.ndarray]) -> None:
    for v, a in zip(variables, arrays):
        v.assign(a.astype(v.dtype, copy=False) if hasattr(a, "astype") else a)


# Rows per validation call: the metrics are the same whatever the chunks (weighted means); fewer calls are
# faster (evaluate() itself costs about 90 ms of set-up per epoch for a few hundred rows).
VALIDATION_CHUNK = 1024


def _validate(model: Any, job: JobMessage, rows: int) -> dict[str, Any]:
    """This worker's validation share on the shared weights, as ``val_`` logs (its training logs taken before)."""
    import keras

    model.reset_metrics()
    logs: dict[str, Any] = {}
    for start in range(0, rows, VALIDATION_CHUNK):
        part = slice(start, start + VALIDATION_CHUNK)

        def cut(a: Any, part: slice = part) -> Any:
            return a[part]

        w = None if job.sample_weight_val is None else keras.tree.map_structure(cut, job.sample_weight_val)
        x_val, y_val = keras.tree.map_structure(cut, job.x_val), keras.tree.map_structure(cut, job.y_val)
        logs = keras_own(model, "test_on_batch")(x_val, y_val, sample_weight=w, return_dict=True)
    return {f"val_{k}": v for k, v in logs.items()}
