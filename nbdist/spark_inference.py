"""Evaluate and predict on Spark data where its partitions live; the driver only checks schemas.

Evaluation runs the usual ``EvaluationJob`` with the Spark backend: each barrier
task writes its partition next to its worker, which evaluates it and answers
with additive metric state, as on the numpy path. Prediction needs no workers
of ours: it is a lazy ``mapInPandas`` over the DataFrame, with the model
broadcast once as JSON and numbers, so the result is a new DataFrame whose rows
never visit the driver.
"""
from __future__ import annotations

import functools
import json
import logging
import uuid
from typing import Any, Sequence

import numpy as np

from .errors import NbdistError
from .spark_data import SparkData, is_spark_rdd, spark_dataset

log = logging.getLogger(__name__)

SPARK_BACKENDS = ("auto", "spark")


def _check_backend(backend: str | None, what: str) -> None:
    if (backend or "auto") not in SPARK_BACKENDS:
        raise NbdistError(f"Spark data is {what} on the Spark backend, where it lives; drop --backend {backend} "
                          "(or convert it first, e.g. df.toPandas(), if it fits in memory).")


def _cell_width(value: Any, name: str) -> int:
    if hasattr(value, "toArray"):  # ML Vector
        return int(value.toArray().size)
    try:
        return int(np.asarray(value, dtype=np.float32).size)
    except (TypeError, ValueError):
        raise NbdistError(f"feature column {name!r} holds {type(value).__name__} values, not numbers; use numeric, "
                          "array-of-numbers or ML Vector columns.") from None


def feature_width(data: SparkData) -> int | None:
    """Values per row across the feature columns: from the schema, or from one row for arrays/vectors."""
    df = data.dataframe
    if df is None:
        return None
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in df.schema.fields}
    cols = data.layout.features
    sized = [c for c in cols if not isinstance(fields[c], T.NumericType)]
    width = len(cols) - len(sized)
    if sized:
        rows = df.select(*sized).head(1)  # one row, to learn the array/vector lengths
        if not rows:
            raise NbdistError("the DataFrame has no rows; pass data with at least one row per worker.")
        for name, value in zip(sized, rows[0]):
            if value is None:
                raise NbdistError(f"feature column {name!r} holds nulls; drop or fill them first (e.g. df.na.drop()).")
            width += _cell_width(value, name)
    return width


def check_width(model: Any, data: SparkData) -> tuple[int, ...] | None:
    """One sentence when the columns cannot feed the model; returns the model's input shape."""
    from .inference import _input_shape

    shape = _input_shape(model)
    width = feature_width(data)
    if shape is not None and width is not None and width != int(np.prod(shape)):
        cols = ", ".join(data.layout.features)
        raise NbdistError(f"the feature columns ({cols}) hold {width} values per row but the model expects "
                          f"{int(np.prod(shape))} (input shape {shape}); name the columns it was trained on.")
    return shape


def check_label_classes(data: SparkData, classes: int) -> None:
    """Sparse class labels must be whole numbers in 0..classes-1: checked in the JVM, one row comes back."""
    from pyspark.sql import functions as F

    label = data.layout.label
    col = F.col(label)
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


def evaluate_spark(model: Any, x: Any, y: Any, features: str | Sequence[str] | None, label: str | None,
                   namespace: dict[str, Any] | None, options: dict[str, Any]) -> dict[str, Any]:
    """``nbdist.evaluate`` on a DataFrame (or an RDD of (features, label)): partitions evaluated in place."""
    from .evaluation import check_labels, classifier_spec
    from .inference import EvaluationJob, _config, check_model

    config = _config(dict(options))
    _check_backend(config.backend, "evaluated")
    check_model(model, "the model", need_compiled=True)
    data = spark_dataset(x, y, features, label)
    check_width(model, data)
    loss = (model.get_compile_config() or {}).get("loss")
    output_shape = tuple(model.outputs[0].shape) if getattr(model, "outputs", None) else ()
    classifier = classifier_spec(loss, output_shape)
    if data.dataframe is not None:  # a numeric label column: one value per row
        if output_shape:
            check_labels((1,), output_shape, loss, what=f"label column {label!r} values")
        if classifier is not None and classifier.kind == "multiclass" and classifier.sparse_labels:
            check_label_classes(data, classifier.classes)
    job = EvaluationJob(model, config, data, namespace, classifier=classifier)
    return job.run()


def predict_spark(model: Any, df: Any, features: str | Sequence[str] | None, namespace: dict[str, Any] | None,
                  options: dict[str, Any], prediction_col: str = "prediction") -> Any:
    """A new DataFrame: ``df``'s columns plus ``prediction_col``, computed lazily on the executors.

    One output value per row gives a double column, several an array<double> column.
    """
    from pyspark.sql import types as T

    from .backends.spark_predict import PredictSpec, pack_weights, predict_batches
    from .inference import _config, check_model, inference_spec

    options = dict(options)
    if options.get("workers") is not None:
        raise NbdistError("prediction on a Spark DataFrame runs in the DataFrame's own partitions; drop --workers "
                          "(repartition the DataFrame to change how many tasks run).")
    options.pop("workers", None)
    config = _config(options)
    _check_backend(config.backend, "predicted")
    if is_spark_rdd(df):
        raise NbdistError("prediction on Spark returns a DataFrame with a prediction column, so it needs a "
                          "DataFrame; convert the RDD first, e.g. spark.createDataFrame(rdd, ['features']).")
    check_model(model, "the model", need_compiled=False)
    if not isinstance(prediction_col, str) or not prediction_col:
        raise NbdistError(f"the prediction column needs a name, got {prediction_col!r}; e.g. prediction_col='prediction'.")
    if prediction_col in df.columns:
        raise NbdistError(f"the DataFrame already has a column {prediction_col!r}; drop it or choose another "
                          "prediction column name.")
    data = spark_dataset(df, None, features, None, label_required=False)
    in_shape = check_width(model, data)
    out_shape = tuple(model.outputs[0].shape[1:])
    if any(d is None for d in out_shape):
        raise NbdistError("the model's output size depends on its input; nbdist predicts fixed-size outputs only.")
    scalar = int(np.prod(out_shape)) == 1
    spec, custom = inference_spec(model, namespace)
    sc = df.sparkSession.sparkContext
    # JSON text and an npz of numbers: nothing the executors would have to unpickle from us.
    broadcast = sc.broadcast({"config": json.dumps(spec.config), "weights": pack_weights(spec.weights)})
    task = PredictSpec(model=broadcast, key=uuid.uuid4().hex, features=data.layout.features, column=prediction_col,
                       batch_size=config.batch_size,
                       input_shape=in_shape if in_shape is not None and len(in_shape) > 1 else None,
                       scalar=scalar, threads=max(1, int(sc.getConf().get("spark.task.cpus", "1") or 1)),
                       custom_objects=custom,
                       udt_columns=tuple((f.name, f.dataType) for f in df.schema.fields
                                         if isinstance(f.dataType, T.UserDefinedType)))
    kind = T.DoubleType() if scalar else T.ArrayType(T.DoubleType(), containsNull=False)
    schema = T.StructType(list(df.schema.fields) + [T.StructField(prediction_col, kind, nullable=False)])
    log.info("prediction column %r added lazily (%d feature columns, model broadcast once)",
             prediction_col, len(task.features))
    return df.mapInPandas(functools.partial(predict_batches, task), schema)
