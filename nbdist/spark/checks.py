"""Checks of Spark data before evaluation or prediction: feature widths and label classes from the schema
or one row, so a mismatch is one sentence on the driver rather than a failed task."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..checks import input_shape
from ..errors import NbdistError
from .cluster import EXECUTOR_WAIT, dataframe_context, executors_for
from .data import SparkData

SPARK_BACKENDS = ("auto", "spark")


def _cell_width(value: Any, name: str) -> int:
    if hasattr(value, "toArray"):  # ML Vector
        return int(value.toArray().size)
    try:
        return int(np.asarray(value, dtype=np.float32).size)
    except (TypeError, ValueError):
        raise NbdistError(f"feature column {name!r} holds {type(value).__name__} values, not numbers; use numeric, "
                          "array-of-numbers or ML Vector columns.") from None


def feature_width(data: SparkData, wait: float = EXECUTOR_WAIT) -> int | None:
    """Values per row across the feature columns: from the schema, or from one row for arrays/vectors (for
    which it waits up to ``wait`` s for an executor: TrainConfig.executor_wait)."""
    df = data.dataframe
    if df is None:
        return None
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in df.schema.fields}
    cols = data.layout.features
    sized = [c for c in cols if not isinstance(fields[c], T.NumericType)]
    width = len(cols) - len(sized)
    if sized:
        with executors_for(dataframe_context(df), wait):  # without executors the row would wait forever
            rows = df.select(*sized).head(1)  # one row, to learn the array/vector lengths
        if not rows:
            raise NbdistError("the DataFrame has no rows; pass data with at least one row per worker.")
        for name, value in zip(sized, rows[0]):
            if value is None:
                raise NbdistError(f"feature column {name!r} holds nulls; drop or fill them first (e.g. df.na.drop()).")
            width += _cell_width(value, name)
    return width


def check_width(model: Any, data: SparkData, wait: float = EXECUTOR_WAIT) -> tuple[int, ...] | None:
    """One sentence when the columns cannot feed the model; returns the model's input shape."""
    shape = input_shape(model)
    width = feature_width(data, wait)
    if shape is not None and width is not None and width != int(np.prod(shape)):
        cols = ", ".join(data.layout.features)
        raise NbdistError(f"the feature columns ({cols}) hold {width} values per row but the model expects "
                          f"{int(np.prod(shape))} (input shape {shape}); name the columns it was trained on.")
    return shape


def check_label_classes(data: SparkData, classes: int, wait: float = EXECUTOR_WAIT) -> None:
    """Sparse class labels must be whole numbers in 0..classes-1: checked in the JVM, one row comes back."""
    from pyspark.sql import functions as F

    label = data.layout.label
    col = F.col(label)
    with executors_for(dataframe_context(data.dataframe), wait):
        low, high, fractional, nulls = data.dataframe.agg(
            F.min(col), F.max(col), F.sum((col != F.floor(col)).cast("long")),
            F.sum(col.isNull().cast("long"))).first()
    if nulls:
        raise NbdistError(f"label column {label!r} holds {nulls} nulls; drop them first (e.g. df.na.drop()).")
    if low is None:
        return  # no rows: the worker count check says so
    if fractional or low < 0 or high > classes - 1:
        raise NbdistError(f"label column {label!r} must hold whole class ids from 0 to {classes - 1} for this "
                          f"{classes}-output model but ranges from {low} to {high}; check the label or the "
                          "model's last layer.")
