"""Distributed evaluation and prediction on the driver: the jobs under ``evaluate()`` and ``predict()``
(inference_api.py, which checks what they are given; the jobs receive it checked).

The jobs are Runs (driver/run.py: coordinator, backend, health checks, shutdown);
only the job message and the answers are theirs. Each worker runs the
model on its shard and answers with additive state (evaluate) or its rows of
predictions (predict); the driver sums the state and computes every metric once.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from ..config import TrainConfig
from ..data.inputs import FitData, PyDatasetData
from ..data.sharding import batch_bounds, share_count, strided_batches
from ..data.structures import concat_flat, flatten, has_text, tf_structure, unflatten_outputs
from ..errors import NbdistError
from ..model.metrics import ClassifierSpec, merge_classifier_stats, sum_states
from ..model.spec import ModelSpec, model_from_spec, travelling_model
from ..model.tensors import keras_data
from ..spark.data import SparkData
from ..wire.messages import JobMessage
from ..wire.reports import Done, Evaluation, Predictions
from .run import Listener, Run

log = logging.getLogger(__name__)


# -- the model spec ------------------------------------------------------------
def inference_spec(model: Any) -> ModelSpec:
    """The model and its weights, without optimizer state."""
    return travelling_model(model, optimizer=False)


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
    data_name = "evaluation data"
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
    data_name = "prediction data"
    answer = Predictions

    def result(self) -> Any:
        """Every worker's rows, in input order (shards are contiguous and in rank order), shaped as
        ``model.predict`` returns them: one array, or the list, tuple, namedtuple or dict the model returns."""
        if isinstance(self.data, PyDatasetData):
            return self._py_dataset_result()
        layout = self.answers[0].layout
        outputs = concat_flat(layout, [self.answers[r].outputs for r in range(self.world_size)])
        return keras_data(unflatten_outputs(layout, iter(outputs)))

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
        return unflatten_outputs(layout, iter(outputs))


def _evaluate_rows(model: Any, x: Any, y: Any, sample_weight: Any) -> None:
    """``model.evaluate`` on a few in-memory rows; text through tf.data, as Keras' array path refuses a
    numpy str dtype (a TextVectorization model's input)."""
    if has_text(x):
        import tensorflow as tf

        parts = tf_structure((x, y) if sample_weight is None else (x, y, sample_weight))
        model.evaluate(tf.data.Dataset.from_tensor_slices(parts).batch(len(flatten(x)[1][0])), verbose=0)
    else:
        model.evaluate(keras_data(x), keras_data(y), sample_weight=keras_data(sample_weight), verbose=0)


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
