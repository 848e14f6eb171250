"""The public ``evaluate()`` and ``predict()``: each turns its model, data and options into one checked
request (``inference_request``: a config and FitData or PyDatasetData, checked against the model by
checks.py) and hands it to its job (driver/inference.py); Spark data is checked and evaluated in place, or
predicted as a lazy DataFrame."""
from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from .checks import (
    check_compiled,
    check_inference_data,
    check_inference_model,
    check_keras_model,
    check_label_column,
    check_single_output_on_spark,
    no_columns,
    outputs,
)
from .config import TrainConfig
from .data.inputs import FitData, PyDatasetData, is_py_dataset, make_fit_data, make_py_dataset_data
from .data.pipelines import inference_rows, is_pipeline, is_split_loader, loader_batches
from .data.structures import map_struct
from .driver.inference import EvaluationJob, PredictionJob, inference_spec
from .errors import NbdistError
from .model.metrics import ClassifierSpec, classifier_spec, compiled_loss
from .model.spec import ensure_built
from .model.tensors import keras_data
from .spark.checks import SPARK_BACKENDS, check_label_classes, check_width
from .spark.cluster import is_connect_session
from .spark.data import is_spark_data, is_spark_rdd, named_frames, spark_dataset, sql_types, vector_label

log = logging.getLogger(__name__)

# Options of TrainConfig that make sense for inference; the rest are training's.
INFERENCE_OPTIONS = {"workers", "backend", "batch_size", "startup_timeout", "heartbeat_interval",
                     "heartbeat_timeout", "warm_workers", "executor_wait", "advertise_host", "container_engine"}


def inference_config(options: dict[str, Any]) -> TrainConfig:
    unknown = set(options) - INFERENCE_OPTIONS
    if unknown:
        raise NbdistError(f"unknown option(s) {', '.join(sorted(unknown))}; use "
                          f"{', '.join(sorted(INFERENCE_OPTIONS))}.")
    options.setdefault("ui", "none")
    options.setdefault("batch_size", 256)
    return TrainConfig(epochs=1, **options)


def inference_request(model: Any, x: Any, y: Any, sample_weight: Any, need_labels: bool, options: dict[str, Any],
                      name: str) -> tuple[TrainConfig, FitData | PyDatasetData]:
    """In-memory data for evaluate (``need_labels``) or predict, as one checked config and data."""
    config = inference_config(options)
    check_keras_model(model, name)
    what = "evaluation data" if need_labels else "prediction data"
    if is_split_loader(x):  # a DataLoader over a lazy map-style dataset: its batches, read by the workers
        x = loader_batches(x, f"the {what}", ordered=not need_labels)
    elif is_pipeline(x):  # read once into the arrays it yields
        x, y, sample_weight = inference_rows(x, y, sample_weight, what)
    data: FitData | PyDatasetData
    if is_py_dataset(x):  # fewer batches than workers is fine: a worker without one adds nothing
        for arg, value in (("y", y), ("sample_weight", sample_weight)):
            if value is not None:
                raise NbdistError(f"the {what} is a keras.utils.PyDataset and {arg} was given too; drop {arg}: the "
                                  "PyDataset's batches hold the labels and weights, (x, y) or (x, y, sample_weight), "
                                  "as in model.evaluate(dataset).")
        data = make_py_dataset_data(x, f"the {what}")
    else:
        if need_labels and y is None:
            raise NbdistError("evaluation needs labels; pass them as y (or --data X,y).")
        data = make_fit_data(x, y, sample_weight, what)
    _build_on(model, data, need_labels)
    check_inference_model(model, name, need_compiled=need_labels)
    check_inference_data(model, data, what, name, need_labels)
    return config, data


def _build_on(model: Any, data: FitData | PyDatasetData, labelled: bool) -> None:
    """A model without weights yet (a Sequential without an Input) built on the data's first row, as Keras'
    evaluate and predict build it on their first batch; the workers' copies then have the same weights."""
    if model.built and model.weights:
        return
    if isinstance(data, FitData):
        x, y = data.x, data.y
    elif data.first_row:
        x, y = data.first_row[0], data.first_row[1] if len(data.first_row) > 1 else None
    else:
        return
    if labelled:
        check_compiled(model, "the model")  # the first problem to name: building needs the loss
        ensure_built(model, x, y)
        return
    try:  # predict_step's call, on one row
        model(keras_data(map_struct(lambda a: a[:1], x)), training=False)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]  # one line: Keras' first
        raise NbdistError(f"the model could not be built on one row of the prediction data ({reason}); check that "
                          "the data fits the model's call().") from None


def _classifier(model: Any, data: FitData | PyDatasetData) -> ClassifierSpec | None:
    """The classifier report's spec: single-output array labels without sample weights (the report counts
    rows, which weighted metrics do not); Keras' metrics only otherwise."""
    if isinstance(data, PyDatasetData) or not isinstance(data.y, np.ndarray) or outputs(model) != 1:
        return None
    if data.sample_weight is not None:
        return None
    output_shape = tuple(model.outputs[0].shape) if getattr(model, "outputs", None) else ()
    return classifier_spec(compiled_loss(model), output_shape)


def evaluate(model: Any, x: Any, y: Any = None, *, sample_weight: Any = None, steps: int | None = None,
             return_dict: bool = True, namespace: dict[str, Any] | None = None,
             features: str | list[str] | None = None, label: str | None = None, weight_col: str | None = None,
             **options: Any) -> Any:
    """Evaluate ``model`` on ``x``/``y`` sharded over workers, with exact merged metrics.

    ``x``, ``y`` and ``sample_weight`` are what ``model.evaluate`` takes (arrays, pandas, dicts or
    lists of them for several inputs and outputs; data/). Returns the compiled metrics by name
    (``loss``, ``accuracy``, ``cls_loss``, ...), as ``model.evaluate(..., return_dict=True)`` would
    compute them on the whole data, plus ``samples``; for a single-output classifier without
    sample weights also ``confusion_matrix`` (rows: true class), ``per_class``
    (precision, recall, f1, support) and ``averages`` (accuracy, macro and weighted
    F1, and for a binary classifier the positive class's precision/recall/F1 and
    the exact ROC AUC). Options: workers, backend, batch_size (default 256), and TrainConfig's warm_workers,
    executor_wait, advertise_host and container_engine.
    ``x`` may be a Spark DataFrame (name its columns with ``features`` and ``label``, and ``weight_col``
    for a column of per-row ``sample_weight``) or an RDD of (features, label) pairs: each Spark task
    then evaluates its partition in place. ``x`` may
    be a ``keras.utils.PyDataset`` of (x, y) or (x, y, sample_weight) batches (no ``y`` beside it):
    each worker evaluates batches rank, rank + workers, ...; Keras' metrics only, no classifier report.
    ``steps`` and ``return_dict`` as ``model.evaluate`` takes them for arrays: the first ``steps`` batches of
    ``batch_size`` rows (Keras' 32 when not given); ``return_dict=False`` gives Keras' list (or one scalar).
    """
    x, _ = named_frames(x, None, features, label)
    if steps is not None and (is_spark_data(x) or is_py_dataset(x) or is_pipeline(x)):
        raise NbdistError("steps applies to in-memory arrays here; evaluate the rows you want (e.g. the first "
                          "steps × batch_size) or drop steps.")
    if is_spark_data(x):
        if sample_weight is not None:
            raise NbdistError("sample_weight is for in-memory data; a Spark DataFrame's per-row weights are one of "
                              "its columns: name it with weight_col='w' (--weight-col w).")
        return evaluate_spark(model, x, y, features, label, namespace, options, weight_col)
    no_columns(features, label, weight_col)
    config, data = inference_request(model, x, y, sample_weight, True, dict(options), "the model")
    if steps is not None:
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise NbdistError(f"steps must be a positive number of batches, got {steps!r}.")
        data = data.slice(0, min(len(data), steps * int(options.get("batch_size") or KERAS_BATCH)))
    results = EvaluationJob(model, config, data, namespace, classifier=_classifier(model, data)).run()
    return results if return_dict else keras_order(model, results)


KERAS_BATCH = 32  # what model.evaluate reads per step when batch_size is not given


def keras_order(model: Any, results: dict[str, Any]) -> Any:
    """``model.evaluate(..., return_dict=False)``'s value: Keras' metrics in its own order (one: a scalar)."""
    metrics = {}
    for key, value in results.items():  # Keras' results come first, then "samples" and the classifier report
        if key == "samples":
            break
        metrics[key] = value
    return model._flatten_metrics_in_order(metrics)


def predict(model: Any, x: Any, *, namespace: dict[str, Any] | None = None,
            features: str | list[str] | None = None, prediction_col: str = "prediction", **options: Any) -> Any:
    """``model.predict(x)`` sharded over workers; rows come back in input order, as ``model.predict``
    returns them (one array, or a list or dict of arrays for a model with several outputs). A
    ``keras.utils.PyDataset`` is predicted batch by batch as ``model.predict(ds)`` reads it, rows in its order.

    For a Spark DataFrame (``features`` names its columns) it returns a new DataFrame with
    ``prediction_col`` added, computed lazily on the executors; no row visits the driver.
    """
    x, _ = named_frames(x, None, features, None)
    if is_spark_data(x):
        return predict_spark(model, x, features, namespace, options, prediction_col)
    no_columns(features, None)
    config, data = inference_request(model, x, None, None, False, dict(options), "the model")
    return PredictionJob(model, config, data, namespace).run()


# -- Spark data: partitions evaluated where they live, predictions as a lazy DataFrame ----------
def evaluate_spark(model: Any, x: Any, y: Any, features: str | Sequence[str] | None, label: str | None,
                   namespace: dict[str, Any] | None, options: dict[str, Any],
                   weight_col: str | None = None) -> dict[str, Any]:
    """``nbdist.evaluate`` on a DataFrame (or an RDD of (features, label)): partitions evaluated in place;
    with ``weight_col`` each row weighs as ``model.evaluate``'s ``sample_weight`` (no classifier report then,
    as for weighted in-memory data)."""
    config = inference_config(dict(options))
    _check_spark_backend(config.backend, "evaluated")
    check_inference_model(model, "the model", need_compiled=True)
    check_single_output_on_spark(model, "evaluated")
    data = spark_dataset(x, y, features, label, weight_col=weight_col)
    check_width(model, data, config.executor_wait)
    loss = compiled_loss(model)
    output_shape = tuple(model.outputs[0].shape) if getattr(model, "outputs", None) else ()
    classifier = classifier_spec(loss, output_shape)
    if data.dataframe is not None and not vector_label(data.dataframe, label):  # one value per row
        check_label_column(model, label)
        if classifier is not None and classifier.kind == "multiclass" and classifier.sparse_labels:
            check_label_classes(data, classifier.classes, config.executor_wait)
    job = EvaluationJob(model, config, data, namespace, classifier=None if weight_col else classifier)
    return job.run()


def predict_spark(model: Any, df: Any, features: str | Sequence[str] | None, namespace: dict[str, Any] | None,
                  options: dict[str, Any], prediction_col: str = "prediction") -> Any:
    """A new DataFrame: ``df``'s columns plus ``prediction_col``, computed lazily on the executors.

    One output value per row gives a double column, several an array<double> column.
    """
    from .spark.predict import PredictSpec, predict_batches

    options = dict(options)
    if options.get("workers") is not None:
        raise NbdistError("prediction on a Spark DataFrame runs in the DataFrame's own partitions; drop --workers "
                          "(repartition the DataFrame to change how many tasks run).")
    options.pop("workers", None)
    config = inference_config(options)
    _check_spark_backend(config.backend, "predicted")
    if is_spark_rdd(df):
        raise NbdistError("prediction on Spark returns a DataFrame with a prediction column, so it needs a "
                          "DataFrame; convert the RDD first, e.g. spark.createDataFrame(rdd, ['features']).")
    check_inference_model(model, "the model", need_compiled=False)
    check_single_output_on_spark(model, "predicted")
    if not isinstance(prediction_col, str) or not prediction_col:
        raise NbdistError(f"the prediction column needs a name, got {prediction_col!r}; "
                          "e.g. prediction_col='prediction'.")
    if prediction_col in df.columns:
        raise NbdistError(f"the DataFrame already has a column {prediction_col!r}; drop it or choose another "
                          "prediction column name.")
    data = spark_dataset(df, None, features, None, label_required=False)
    in_shape = check_width(model, data, config.executor_wait)
    out_shape = tuple(model.outputs[0].shape[1:])
    if any(d is None for d in out_shape):
        raise NbdistError("the model's output size depends on its input; nbdist predicts fixed-size outputs only.")
    scalar = int(np.prod(out_shape)) == 1
    spec = inference_spec(model)
    spark_types = sql_types()
    session = df.sparkSession
    # The model (its objects and weights) goes inside Spark's own broadcast or task closure, as any UDF's
    # code does: nbdist opens no channel of its own to the executors here.
    payload = {"spec": spec}
    if not is_connect_session(session):
        payload = session.sparkContext.broadcast(payload)  # once per executor, not per task
    # Over Connect there is no broadcast: the model travels inside the function's closure.
    task = PredictSpec(model=payload, key=uuid.uuid4().hex, features=data.layout.features, column=prediction_col,
                       batch_size=config.batch_size,
                       input_shape=in_shape if in_shape is not None and len(in_shape) > 1 else None,
                       scalar=scalar, threads=max(1, int(session.conf.get("spark.task.cpus", "1") or 1)),
                       udt_columns=tuple((f.name, f.dataType) for f in df.schema.fields
                                         if isinstance(f.dataType, spark_types.UserDefinedType)))
    kind = spark_types.DoubleType() if scalar else spark_types.ArrayType(spark_types.DoubleType(), containsNull=False)
    column = spark_types.StructField(prediction_col, kind, nullable=False)
    schema = spark_types.StructType(list(df.schema.fields) + [column])
    log.info("prediction column %r added lazily (%d feature columns)", prediction_col, len(task.features))
    return df.mapInPandas(functools.partial(predict_batches, task), schema)


def _check_spark_backend(backend: str | None, what: str) -> None:
    if (backend or "auto") not in SPARK_BACKENDS:
        raise NbdistError(f"Spark data is {what} on the Spark backend, where it lives; drop --backend {backend} "
                          "(or convert it first, e.g. df.toPandas(), if it fits in memory).")
