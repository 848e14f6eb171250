"""Prediction inside Spark's Python workers: the function ``DataFrame.mapInPandas`` runs per partition.

Everything here runs on the executors, so only the standard library, numpy and
pandas are imported at module level. The model travels as plain data: its JSON
config and its weights as an ``.npz`` blob (read with ``allow_pickle=False``),
in one broadcast per call on a classic session (shipped once per executor, not
per task), inside the function's closure over Spark Connect (which has no broadcast).
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..worker.runtime import pin_threads
from .task import _feature_block, vector_values

# Built models per Python worker process, by broadcast id: Spark reuses its Python workers,
# so later partitions (and batches) of the same call skip rebuilding the model.
# Keyed by PredictSpec.key (a worker-side Broadcast has no id of its own).
_MODELS: dict[str, Any] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True)
class PredictSpec:
    """What each task needs besides the broadcast model."""

    model: Any  # {"config": json text, "weights": npz bytes}, or a pyspark Broadcast of it (classic sessions)
    key: str  # unique per predict call
    features: tuple[str, ...]
    column: str  # the prediction column to add
    batch_size: int
    input_shape: tuple[int, ...] | None  # reshape flat feature rows to this when the model wants images
    scalar: bool  # one output value per row: a double column, else an array<double> column
    threads: int = 1
    # Columns of a user-defined type (ML Vectors): Arrow hands them over as their struct. Spark 4 needs the
    # objects back, so each is rebuilt with its own type's deserialize(); Spark 3.5 takes the struct back.
    udt_columns: tuple[tuple[str, Any], ...] = ()


def feature_matrix(columns: Sequence[Sequence[Any]], names: Sequence[str]) -> np.ndarray:
    """Rows of the named feature columns as one float32 (rows, width) matrix."""
    blocks = [_feature_block([vector_values(v) for v in values], name) for values, name in zip(columns, names)]
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)


def as_column(out: np.ndarray, scalar: bool) -> Any:
    """Model outputs as a pandas column: doubles, or one array of doubles per row."""
    out = np.asarray(out, dtype=np.float64).reshape(len(out), -1)
    if scalar:
        return out[:, 0]
    return list(out)


def _model(spec: PredictSpec) -> Any:
    with _LOCK:
        model = _MODELS.get(spec.key)
        if model is None:
            # Use the task's cores only; TensorFlow refuses once this Python worker already ran it.
            with contextlib.suppress(RuntimeError):
                pin_threads(spec.threads)
            from ..model.spec import model_from_spec

            payload = spec.model.value if hasattr(spec.model, "value") else spec.model  # a broadcast, or the dict
            model = model_from_spec(payload["spec"])
            _MODELS.clear()  # one call's model at a time: earlier calls' are garbage
            _MODELS[spec.key] = model
        return model


def predict_batches(spec: PredictSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """The ``mapInPandas`` function: each pandas batch comes back with the prediction column added."""
    model = None
    udt_columns = spec.udt_columns if udt_objects_back() else ()  # decided once per partition, not per batch
    for pdf in batches:
        if len(pdf) == 0:
            pdf[spec.column] = np.zeros(0) if spec.scalar else []
            yield pdf
            continue
        if model is None:
            model = _model(spec)
        x = feature_matrix([pdf[name] for name in spec.features], spec.features)
        if spec.input_shape is not None and x.shape[1:] != spec.input_shape:
            x = x.reshape((len(x), *spec.input_shape))
        out = model.predict(x, batch_size=spec.batch_size, verbose=0)
        pdf[spec.column] = as_column(out, spec.scalar)
        for name, udt in udt_columns:
            pdf[name] = [_udt_value(udt, cell) for cell in pdf[name]]
        yield pdf


def udt_objects_back() -> bool:
    """Whether this Spark converts a returned column of a user-defined type from its objects (Spark 4, which
    refuses the struct Arrow handed over), else from that struct (Spark 3.5, which refuses the objects)."""
    import pyspark

    return int(pyspark.__version__.split(".")[0]) >= 4


def _udt_value(udt: Any, cell: Any) -> Any:
    if not isinstance(cell, dict):
        return cell
    return udt.deserialize(tuple(cell[f.name] for f in udt.sqlType().fields))
