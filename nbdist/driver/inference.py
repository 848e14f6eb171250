"""Distributed evaluation and prediction on the driver: ``evaluate()``, ``predict()`` and their jobs.

The jobs are Runs (driver/run.py: coordinator, backend, health checks, shutdown);
only the job message and the answers are theirs. Each worker runs the
model on its shard and answers with additive state (evaluate) or its rows of
predictions (predict); the driver sums the state and computes every metric once.
"""
from __future__ import annotations

import functools
import logging
import uuid
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..checks import check_labels_fit_loss, check_text_inputs, fits_input, input_shape
from ..config import TrainConfig
from ..data import (
    FitData,
    PyDatasetData,
    batch_bounds,
    check_workers,
    flatten,
    has_text,
    is_py_dataset,
    make_fit_data,
    make_py_dataset_data,
    share_count,
    strided_batches,
    tf_structure,
    unflatten,
)
from ..errors import NbdistError
from ..metrics import (
    ClassifierSpec,
    check_labels,
    classifier_spec,
    compiled_loss,
    labels_are_classes,
    merge_classifier_stats,
    sum_states,
)
from ..model_io import ModelSpec, is_keras_model, model_from_spec, travelling_model
from ..pipelines import inference_rows
from ..spark.backend import is_connect_session
from ..spark.checks import SPARK_BACKENDS, check_label_classes, check_width
from ..spark.data import SparkData, is_spark_data, is_spark_rdd, spark_dataset, sql_types
from ..wire.messages import JobMessage
from ..wire.reports import Done, Evaluation, Predictions
from .run import Listener, Run

log = logging.getLogger(__name__)

# Options of TrainConfig that make sense for inference; the rest are training's.
INFERENCE_OPTIONS = {"workers", "backend", "batch_size", "startup_timeout", "heartbeat_interval",
                     "heartbeat_timeout"}


# -- checks and the model spec -------------------------------------------------
def check_model(model: Any, name: str, need_compiled: bool) -> None:
    if not is_keras_model(model):
        raise NbdistError(f"{name} is a {type(model).__name__}, not a Keras model; pass a keras.Model.")
    if not model.built or not model.weights:
        raise NbdistError(f"{name} has no weights yet (it was never built or trained); train it first, "
                          "e.g. with %%dist_train or model.fit.")
    if need_compiled and not getattr(model, "compiled", False):
        raise NbdistError(f"{name} is not compiled, so it has no loss or metrics to evaluate; call "
                          f"{name}.compile(optimizer, loss, metrics=[...]) first.")
    if need_compiled and not _has_trained(model):
        warnings.warn(f"{name} has never been trained (its optimizer took no step); the metrics describe its "
                      "initial weights — ignore this if you loaded trained weights.", stacklevel=3)


def _outputs(model: Any) -> int:
    return len(getattr(model, "outputs", None) or [None])


def _single_output_on_spark(model: Any, what: str) -> None:
    """A DataFrame's label and prediction are one column each: Spark takes single-output models."""
    if _outputs(model) > 1:
        raise NbdistError(f"the model has several outputs, and a Spark DataFrame is {what} with one label or "
                          "prediction column; pass the rows in memory as a dict or list per output (e.g. from "
                          "df.toPandas()), or a single-output model.")


def _has_trained(model: Any) -> bool:
    """model.fit builds the optimizer and counts steps; %%dist_train builds it but leaves the count at 0."""
    opt = getattr(model, "optimizer", None)
    try:
        return opt is None or bool(opt.built) or int(np.asarray(opt.iterations)) > 0
    except Exception:  # an optimizer without a step counter: nothing to judge by
        return True


def inference_spec(model: Any) -> ModelSpec:
    """The model and its weights, without optimizer state."""
    return travelling_model(model, optimizer=False)


def _config(options: dict[str, Any]) -> TrainConfig:
    unknown = set(options) - INFERENCE_OPTIONS
    if unknown:
        raise NbdistError(f"unknown option(s) {', '.join(sorted(unknown))}; use "
                          f"{', '.join(sorted(INFERENCE_OPTIONS))}.")
    options.setdefault("ui", "none")
    options.setdefault("batch_size", 256)
    return TrainConfig(epochs=1, **options)


# -- jobs ----------------------------------------------------------------------
class InferenceJob(Run):
    """A run whose workers evaluate or predict once: one job each, one answer each."""

    kind = "inference"
    answer: type = Evaluation  # the message type (wire/reports.py) that carries a worker's result

    def __init__(self, model: Any, config: TrainConfig, data: FitData | PyDatasetData | SparkData,
                 namespace: dict[str, Any] | None = None, listeners: list[Listener] | None = None) -> None:
        super().__init__(model, config, data, namespace, listeners)
        self.answers: dict[int, Any] = {}  # rank -> its answer (an ``answer``)
        self._py_dataset: bytes | None = None  # a PyDataset: what every worker gets, by value (_prepare)

    def _make_spec(self) -> ModelSpec:
        return inference_spec(self.model)

    def _job_message(self, rank: int, **fields: Any) -> JobMessage:
        return self._common_job(rank, self.kind, py_datasets=self._py_dataset, **fields)

    def _plan_shards(self, backend: Any, world: int) -> list[tuple[int, int]] | None:
        """A PyDataset: every worker reads whole batches of it, strided as training reads them
        (``data.share_indices``); a worker left without one (fewer batches than workers) answers with
        no rows. Rows per batch are known only once read: batch 0's stand in for progress."""
        if not isinstance(self.data, PyDatasetData):
            return super()._plan_shards(backend, world)
        return [(0, share_count(self.data.batches, r, world) * self.data.first_rows) for r in range(world)]

    def _batch_sizes(self) -> list[int]:
        if isinstance(self.data, PyDatasetData):
            return [self.data.first_rows] * self.world_size
        return super()._batch_sizes()

    def _shard(self, rank: int) -> FitData | None:
        return None if isinstance(self.data, PyDatasetData) else super()._shard(rank)

    def _prepare(self) -> None:
        if isinstance(self.data, PyDatasetData):
            import cloudpickle

            self._py_dataset = cloudpickle.dumps({"inference": self.data})

    def _file_rows(self, rank: int) -> dict[str, Any] | None:
        """A memory-mapped .npy stays on disk for local workers: each reads its rows from the file."""
        source, files = self._x_file(), self._x_leaves()
        if source is not None:
            return source.rows(*self._shards[rank])
        return {"leaves": {str(i): f.rows(*self._shards[rank]) for i, f in files.items()}} if files else None

    def _on_message(self, rank: int, msg: Any) -> bool:
        if isinstance(msg, self.answer):
            self.answers[rank] = msg
            return True
        if isinstance(msg, Done) and rank not in self.answers:
            self._fail(rank, f"{self._name(rank)} finished without sending its {self.answer.TYPE}", "")
            return True
        return False

    def run(self) -> Any:
        self.start()
        self.wait()
        return self.result()

    def result(self) -> Any:
        raise NotImplementedError


class EvaluationJob(InferenceJob):
    kind = "evaluate"
    answer = Evaluation

    def __init__(self, *args: Any, classifier: ClassifierSpec | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.classifier = classifier

    def _job_message(self, rank: int) -> JobMessage:
        return super()._job_message(rank, classifier=self.classifier.to_json() if self.classifier else None)

    def _plan_shards(self, backend: Any, world: int) -> list[tuple[int, int]] | None:
        """Whole batches per worker: Keras' per-output losses under sample weights depend on where batches
        begin (measured: 2.526 with batches of 64 against 2.426 in one batch), so each worker evaluates
        batches of the local ``evaluate``'s one pass, and the merged state is the local one."""
        shards = super()._plan_shards(backend, world)
        if shards is None or isinstance(self.data, PyDatasetData):  # a PyDataset's batches are its own
            return shards
        return batch_bounds(len(self.data), self.config.batch_size, world)

    def result(self) -> dict[str, Any]:
        """Merged metrics: the compiled metrics by name, then the classifier report if there is one."""
        # A Spark partition may be empty: its worker has no metric state to add.
        answers: list[Evaluation] = [self.answers[r] for r in range(self.world_size) if self.answers[r].rows > 0]
        if not answers:
            raise NbdistError("the evaluation data has no rows; pass at least one labelled example.")
        names = answers[0].names
        if any(a.names != names for a in answers):
            raise NbdistError("workers reported different metrics; rerun the evaluation.")
        merged = sum_states([a.state for a in answers])
        if isinstance(self.data, FitData):  # the driver's copy runs Keras' evaluate on one of the rows
            first = self.data.slice(0, 1)
            build = lambda m: _evaluate_rows(m, first.x, first.y, first.sample_weight)
        elif isinstance(self.data, PyDatasetData):  # the row the driver read of the PyDataset's batch 0
            x1, y1, w1 = (*self.data.first_row, None)[:3]
            build = lambda m: _evaluate_rows(m, x1, y1, w1)
        else:  # Spark: the rows are on the executors; a worker sent one label row and its prediction
            y_row, y_pred_row = (np.zeros(0) if a is None else a for a in (answers[0].y_row, answers[0].y_pred_row))
            build = lambda m: m.compute_metrics(None, y_row, y_pred_row)
        out: dict[str, Any] = keras_results(self._spec, names, merged, build)
        out["samples"] = int(sum(a.rows for a in answers))
        if self.classifier is not None:
            report = merge_classifier_stats([a.stats for a in answers], self.classifier)
            if report is not None:
                out.update(report)
        return out


class PredictionJob(InferenceJob):
    kind = "predict"
    answer = Predictions

    def result(self) -> Any:
        """Every worker's rows, in input order (shards are contiguous and in rank order), shaped as
        ``model.predict`` returns them: one array, or a list or dict of arrays for several outputs."""
        if isinstance(self.data, PyDatasetData):
            return self._py_dataset_result()
        parts = [self.answers[r].outputs for r in range(self.world_size)]
        outputs = [np.concatenate([p[i] for p in parts], axis=0) for i in range(len(parts[0]))]
        return unflatten(self.answers[0].layout, iter(outputs))

    def _py_dataset_result(self) -> Any:
        """A PyDataset's predictions in its order: each worker's batches split by their rows, then put back
        in the order the workers' strided shares were dealt from (``data.strided_batches``)."""
        answers: list[Predictions] = [self.answers[r] for r in range(self.world_size)]
        layout = next(a.layout for a in answers if a.rows > 0)
        outputs = []
        for i in range(len(next(a.outputs for a in answers if a.rows > 0))):
            shares = [np.split(a.outputs[i], np.cumsum(a.batch_rows)[:-1]) if a.rows > 0 else []
                      for a in answers]
            outputs.append(np.concatenate(strided_batches(shares), axis=0))
        return unflatten(layout, iter(outputs))


def _evaluate_rows(model: Any, x: Any, y: Any, sample_weight: Any) -> None:
    """``model.evaluate`` on a few in-memory rows; text through tf.data, as Keras' array path refuses a
    numpy str dtype (a TextVectorization model's input)."""
    if has_text(x):
        import tensorflow as tf

        parts = tf_structure((x, y) if sample_weight is None else (x, y, sample_weight))
        model.evaluate(tf.data.Dataset.from_tensor_slices(parts).batch(len(flatten(x)[1][0])), verbose=0)
    else:
        model.evaluate(x, y, sample_weight=sample_weight, verbose=0)


def keras_results(spec: ModelSpec, names: list[str], state: list[np.ndarray], build: Any) -> dict[str, Any]:
    """The compiled metrics' values from merged state, computed by Keras's own ``result()``: what
    ``model.evaluate(..., return_dict=True)`` returns. ``build(model)`` makes the copy's metric variables."""
    template = model_from_spec(spec, weights=False)  # a copy: the notebook's model keeps its metric state
    build(template)  # builds the metric variables (and the losses' trackers) for these shapes
    template.reset_metrics()
    variables = template.metrics_variables
    if [v.path for v in variables] != names:
        raise NbdistError("the driver's copy of the model has different metrics from the workers'; "
                          "define custom metrics at the top level of the notebook and rerun.")
    for v, value in zip(variables, state):
        if value.size != int(np.prod(v.shape)):
            raise NbdistError(f"metric variable {v.path} has {int(np.prod(v.shape))} values on the driver but "
                              f"{value.size} on the workers; rerun the evaluation.")
        # The wire sends 0-d arrays as shape (1,): restore the variable's own shape.
        v.assign(value.reshape(tuple(v.shape)).astype(v.dtype))
    out: dict[str, Any] = {}
    for name, value in template.get_metrics_result().items():
        arr = np.asarray(value)
        out[name] = float(arr) if arr.ndim == 0 else arr
    return out


# -- the API -------------------------------------------------------------------
def _prepare(model: Any, x: Any, y: Any, sample_weight: Any, need_labels: bool, options: dict[str, Any],
             name: str) -> tuple[TrainConfig, FitData | PyDatasetData]:
    config = _config(options)
    check_model(model, name, need_compiled=need_labels)
    what = "evaluation data" if need_labels else "prediction data"
    x, y, sample_weight = inference_rows(x, y, sample_weight, what)  # an input pipeline: its arrays
    if is_py_dataset(x):  # fewer batches than workers is fine: a worker without one adds nothing
        return config, _py_dataset(model, x, y, sample_weight, need_labels, what, name)
    if need_labels and y is None:
        raise NbdistError("evaluation needs labels; pass them as y (or --data X,y).")
    data = make_fit_data(x, y, sample_weight, what)
    in_shape = input_shape(model)
    if in_shape is not None and isinstance(data.x, np.ndarray) and not fits_input(data.x.shape[1:], in_shape):
        raise NbdistError(f"the features have shape {tuple(data.x.shape[1:])} per row but {name} expects "
                          f"{in_shape}; pass data shaped like the training data.")
    check_text_inputs(model, data.x, what)
    if config.workers is not None:
        check_workers(len(data), config.workers, what)
    return config, data


def _py_dataset(model: Any, dataset: Any, y: Any, sample_weight: Any, need_labels: bool, what: str,
                name: str) -> PyDatasetData:
    """A PyDataset as ``model.evaluate`` / ``model.predict`` take it: its batches hold the labels and weights."""
    for arg, value in (("y", y), ("sample_weight", sample_weight)):
        if value is not None:
            raise NbdistError(f"the {what} is a keras.utils.PyDataset and {arg} was given too; drop {arg}: the "
                              "PyDataset's batches hold the labels and weights, (x, y) or (x, y, sample_weight), "
                              "as in model.evaluate(dataset).")
    data = make_py_dataset_data(dataset, f"the {what}")
    if need_labels and len(data.first_row) < 2:
        raise NbdistError(f"the {what} is a PyDataset whose batches hold no labels; return (x, y) or "
                          "(x, y, sample_weight) from its __getitem__ to evaluate on it.")
    first_x = data.first_row[0]
    in_shape = input_shape(model)
    if in_shape is not None and isinstance(first_x, np.ndarray) and not fits_input(first_x.shape[1:], in_shape):
        raise NbdistError(f"the PyDataset's batches have features of shape {tuple(first_x.shape[1:])} per row but "
                          f"{name} expects {in_shape}; return batches shaped like the training data.")
    check_text_inputs(model, first_x, what)
    return data


def _no_columns(features: Any, label: Any) -> None:
    if features is not None or label is not None:
        raise NbdistError("--features and --label name the columns of a Spark DataFrame; with numpy or pandas "
                          "data pass --data X,y instead.")


def evaluate(model: Any, x: Any, y: Any = None, *, sample_weight: Any = None,
             namespace: dict[str, Any] | None = None, features: str | list[str] | None = None,
             label: str | None = None, **options: Any) -> dict[str, Any]:
    """Evaluate ``model`` on ``x``/``y`` sharded over workers, with exact merged metrics.

    ``x``, ``y`` and ``sample_weight`` are what ``model.evaluate`` takes (arrays, pandas, dicts or
    lists of them for several inputs and outputs; data.py). Returns the compiled metrics by name
    (``loss``, ``accuracy``, ``cls_loss``, ...), as ``model.evaluate(..., return_dict=True)`` would
    compute them on the whole data, plus ``samples``; for a single-output classifier without
    sample weights also ``confusion_matrix`` (rows: true class), ``per_class``
    (precision, recall, f1, support) and ``averages`` (accuracy, macro and weighted
    F1, and for a binary classifier the positive class's precision/recall/F1 and
    the exact ROC AUC). Options: workers, backend, batch_size (default 256).
    ``x`` may be a Spark DataFrame (name its columns with ``features`` and ``label``) or an
    RDD of (features, label) pairs: each Spark task then evaluates its partition in place. ``x`` may
    be a ``keras.utils.PyDataset`` of (x, y) or (x, y, sample_weight) batches (no ``y`` beside it):
    each worker evaluates batches rank, rank + workers, ...; Keras' metrics only, no classifier report.
    """
    if is_spark_data(x):
        if sample_weight is not None:
            raise NbdistError("sample_weight is for in-memory data; a Spark DataFrame is evaluated unweighted "
                              "(evaluate a weighted sample in memory instead, e.g. df.limit(n).toPandas()).")
        return evaluate_spark(model, x, y, features, label, namespace, options)
    _no_columns(features, label)
    config, data = _prepare(model, x, y, sample_weight, True, dict(options), "the model")
    if isinstance(data, PyDatasetData):  # Keras' metrics only: the labels stay in the dataset's batches
        return EvaluationJob(model, config, data, namespace).run()
    if not isinstance(data.y, np.ndarray) or _outputs(model) != 1:  # several outputs: Keras' metrics only
        return EvaluationJob(model, config, data, namespace).run()
    loss = compiled_loss(model)
    output_shape = tuple(model.outputs[0].shape) if getattr(model, "outputs", None) else ()
    check_labels_fit_loss(model, data.y, data.sample_weight, "evaluation data")
    # The classifier report counts rows: with sample weights it would not be what the weighted metrics say.
    classifier = classifier_spec(loss, output_shape) if data.sample_weight is None else None
    if classifier is not None and classifier.kind == "multiclass" and classifier.sparse_labels \
            and not labels_are_classes(data.y, classifier):
        raise NbdistError(f"the labels must be whole class ids from 0 to {classifier.classes - 1} for this "
                          f"{classifier.classes}-output model; check y or the model's last layer.")
    job = EvaluationJob(model, config, data, namespace, classifier=classifier)
    return job.run()


def predict(model: Any, x: Any, *, namespace: dict[str, Any] | None = None,
            features: str | list[str] | None = None, prediction_col: str = "prediction", **options: Any) -> Any:
    """``model.predict(x)`` sharded over workers; rows come back in input order, as ``model.predict``
    returns them (one array, or a list or dict of arrays for a model with several outputs). A
    ``keras.utils.PyDataset`` is predicted batch by batch as ``model.predict(ds)`` reads it, rows in its order.

    For a Spark DataFrame (``features`` names its columns) it returns a new DataFrame with
    ``prediction_col`` added, computed lazily on the executors; no row visits the driver.
    """
    if is_spark_data(x):
        return predict_spark(model, x, features, namespace, options, prediction_col)
    _no_columns(features, None)
    config, data = _prepare(model, x, None, None, False, dict(options), "the model")
    return PredictionJob(model, config, data, namespace).run()


# -- Spark data: partitions evaluated where they live, predictions as a lazy DataFrame ----------
def evaluate_spark(model: Any, x: Any, y: Any, features: str | Sequence[str] | None, label: str | None,
                   namespace: dict[str, Any] | None, options: dict[str, Any]) -> dict[str, Any]:
    """``nbdist.evaluate`` on a DataFrame (or an RDD of (features, label)): partitions evaluated in place."""
    config = _config(dict(options))
    _check_spark_backend(config.backend, "evaluated")
    check_model(model, "the model", need_compiled=True)
    _single_output_on_spark(model, "evaluated")
    data = spark_dataset(x, y, features, label)
    check_width(model, data)
    loss = compiled_loss(model)
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
    from ..spark.predict import PredictSpec, predict_batches

    options = dict(options)
    if options.get("workers") is not None:
        raise NbdistError("prediction on a Spark DataFrame runs in the DataFrame's own partitions; drop --workers "
                          "(repartition the DataFrame to change how many tasks run).")
    options.pop("workers", None)
    config = _config(options)
    _check_spark_backend(config.backend, "predicted")
    if is_spark_rdd(df):
        raise NbdistError("prediction on Spark returns a DataFrame with a prediction column, so it needs a "
                          "DataFrame; convert the RDD first, e.g. spark.createDataFrame(rdd, ['features']).")
    check_model(model, "the model", need_compiled=False)
    _single_output_on_spark(model, "predicted")
    if not isinstance(prediction_col, str) or not prediction_col:
        raise NbdistError(f"the prediction column needs a name, got {prediction_col!r}; "
                          "e.g. prediction_col='prediction'.")
    if prediction_col in df.columns:
        raise NbdistError(f"the DataFrame already has a column {prediction_col!r}; drop it or choose another "
                          "prediction column name.")
    data = spark_dataset(df, None, features, None, label_required=False)
    in_shape = check_width(model, data)
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
