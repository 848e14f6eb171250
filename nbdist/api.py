"""The Python API, and the one door under the magics: ``train()``, ``evaluate()``, ``predict()``
(inference_api.py) and ``TrainingJob``. Each entry turns what it is given into one checked request here
(checks.py holds every check of a model against its data); the driver receives it checked."""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

from .checks import check_built, check_fits_model, check_no_custom_loop, check_not_stateful, check_trainable, no_columns
from .config import TrainConfig, implied_strategy
from .data.files import not_in_memory, pipeline_message
from .data.inputs import FitData, PyDatasetData, is_py_dataset, make_fit_data, make_py_dataset_data
from .data.pipelines import (
    check_any,
    fit_from_pipelines,
    is_generator,
    is_pipeline,
    is_split_loader,
    reads_once,
    split_loaders,
)
from .driver.fit_call import check_fit_arguments, fit_data, fit_plan, intercept_fit, prepare_fit_run
from .driver.training import TrainingJob
from .errors import NbdistError
from .fit_arguments import FitCall
from .inference_api import evaluate, predict
from .model.spec import chosen_strategy, ensure_built, is_keras_model, other_distribution
from .spark.checks import feature_width
from .spark.data import is_spark_data, named_frames, spark_dataset, spark_validation
from .ui import make_renderer
from .ui.tracking import track, wanted

log = logging.getLogger(__name__)


def train(model: Any, x: Any, y: Any = None, *, validation_data: tuple[Any, ...] | None = None,
          callbacks: list[Any] | None = None, class_weight: dict[Any, float] | None = None,
          sample_weight: Any = None, validation_split: float = 0.0, initial_epoch: int = 0,
          namespace: dict[str, Any] | None = None, features: str | list[str] | None = None,
          label: str | None = None, weight_col: str | None = None, **options: Any) -> TrainingJob:
    """Train ``model`` data-parallel on ``x``/``y`` and put the trained weights back into it.

    Options are the fields of ``TrainConfig`` (epochs, batch_size, workers: N or ``"MIN:MAX"``, an elastic run that
    goes on without a lost worker (docs/elastic.md), commit_every: its steps between commits, strategy, backend,
    averaging_frequency, seed, shuffle, ui, background, ...; where the workers come from: warm_workers,
    executor_wait, advertise_host, container_engine, which the magics take from the session's
    ``%config DistMagics.<name>``). Blocks until
    training ends unless ``background=True``; returns the ``TrainingJob`` either way.
    The API is silent by default (``ui="none"``). ``x`` may be a Spark DataFrame (name its
    columns with ``features`` and ``label``, and ``weight_col`` for a column of per-row
    ``sample_weight``) or an RDD of (features, label) pairs: each Spark task then reads its own
    partition on its executor. With a training DataFrame,
    ``validation_data`` may be a DataFrame with the same columns: each task writes its share of
    it too, and the workers stream it as they stream their training rows. ``callbacks`` run here at its epochs'
    ends as at a fit's; the other arguments below need in-memory data.

    Otherwise this is ``model.fit(x, y, ...)`` on the workers (the same data path, data/):
    ``x``/``y`` as arrays, pandas, dicts or lists of them, or a ``keras.utils.PyDataset``;
    ``callbacks``, ``class_weight``, ``sample_weight``, ``validation_split``, ``validation_data``
    (2- or 3-tuples, or a PyDataset) and ``initial_epoch`` mean what they mean in ``model.fit``:
    callbacks run here with the merged metrics (``job.fit_history`` is their
    ``keras.callbacks.History``). ``batch_size`` stays per worker: every global batch of
    ``batch_size * workers`` rows is split over the workers.
    """
    unknown = set(options) - TrainConfig.field_names()
    if unknown:
        raise NbdistError(f"unknown option(s) {', '.join(sorted(unknown))}; see help(nbdist.TrainConfig).")
    options.setdefault("ui", "none")
    config = TrainConfig(**implied_strategy(options))
    x, validation_data = named_frames(x, validation_data, features, label)
    if is_spark_data(x):
        if class_weight is not None or sample_weight is not None or bool(validation_split) or bool(initial_epoch):
            raise NbdistError("class_weight, sample_weight, validation_split and initial_epoch need in-memory data "
                              "(numpy or pandas); a Spark DataFrame trains without them (its per-row weights are a "
                              "column: weight_col='w'; its validation data a DataFrame or arrays: validation_data).")
        job = prepare(model, config, x, y, validation_data, namespace, features=features, label=label,
                      weight_col=weight_col, callbacks=callbacks)
    else:
        no_columns(features, label, weight_col)
        fit = fit_arguments(x, y, config, validation_data=validation_data, callbacks=callbacks,
                            class_weight=class_weight, sample_weight=sample_weight,
                            validation_split=validation_split, initial_epoch=initial_epoch)
        job = prepare_fit(model, config, fit, None, namespace)
    job.start()
    if config.background:
        return job.run_in_background()
    job.wait()
    return job


def stop_warm_workers() -> None:
    """Stop the notebook's fork servers (backends/warm.py): its session turned warm workers off."""
    from .backends.warm import POOL

    POOL.close()


def fit_arguments(x: Any, y: Any, config: TrainConfig, **given: Any) -> FitCall:
    """``model.fit``'s arguments for ``x``/``y`` and ``given`` (``--data X,y``, ``nbdist.train``): their sugar."""
    return FitCall(x=x, y=y, epochs=config.epochs, shuffle=config.shuffle,
                   **{k: v for k, v in given.items() if v is not None})


def prepare(model: Any, config: TrainConfig, x: Any, y: Any, validation_data: tuple[Any, ...] | None,
            namespace: dict[str, Any] | None = None, listeners: list[Any] | None = None,
            features: str | list[str] | None = None, label: str | None = None,
            weight_col: str | None = None, callbacks: list[Any] | None = None) -> TrainingJob:
    """Check the inputs and build a job for ``--data X,y``, not yet started: nothing has touched the model.
    In-memory data is ``model.fit(x, y, validation_data=...)`` (``prepare_fit``); Spark data stays where it is,
    and the notebook's ``callbacks`` run at its epochs' ends as at a fit's."""
    x, validation_data = named_frames(x, validation_data, features, label)
    if not is_spark_data(x):
        no_columns(features, label, weight_col)
        fit = fit_arguments(x, y, config, validation_data=validation_data, callbacks=callbacks)
        return prepare_fit(model, config, fit, None, namespace, listeners)
    callbacks_only = FitCall(epochs=config.epochs, callbacks=callbacks)
    check_fit_arguments(callbacks_only)
    train_set = spark_dataset(x, y, features, label, weight_col=weight_col)
    val_set = None
    if spark_validation_data(validation_data):
        # Streamed as the training data is: each task writes its share beside its partition.
        train_set.validation = spark_validation(train_set, validation_data)
    elif validation_data is not None:
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) not in (2, 3):
            raise NbdistError("validation_data must be (x_val, y_val), (x_val, y_val, val_sample_weight) or, "
                              "with a training DataFrame, a Spark DataFrame with the same columns.")
        val_set = make_fit_data(*validation_data, what="validation data")
    check_trainable(model, built=False)
    check_not_stateful(model)
    # The rows are on the executors, but a model built with build(shape) must have every weight
    # here too: the workers' weights come back into it.
    ensure_built(model, None, None)
    if not model.built and not model.weights:  # no input shape: built on a zero row as wide as the columns
        ensure_built(model, None, None, width=feature_width(train_set, config.executor_wait))
    check_built(model)
    run = None if callbacks is None else prepare_fit_run(model, callbacks_only, config.epochs, None, 0)
    return _job(model, config, train_set, val_set, namespace, listeners, fit_run=run)


def prepare_fit(model: Any, config: TrainConfig, fit: FitCall, global_batch: int | None,
                namespace: dict[str, Any] | None = None, listeners: list[Any] | None = None) -> TrainingJob:
    """A job for one ``model.fit(...)``'s arguments (driver/fit_call.py), not yet started: the door of every
    in-memory run (``nbdist.train``, ``--data X,y``, a cell's fit, a trial's), where they are checked once."""
    fit, config = loaders_split(fit, config)
    if reads_once(fit):  # read once into the arrays it yields
        piped = is_pipeline(fit.x) or is_generator(fit.x)
        fit = fit_from_pipelines(fit)
        if piped and global_batch is None:  # --data ds, nbdist.train(model, ds): its batch is the global one
            global_batch = fit.batch_size
            config = config.replace(shuffle=fit.shuffle,
                                    **({"lr_scaling": "none"} if config.lr_scaling == "auto" else {}))
    spark_in_fit(fit.x, fit.validation_data)
    kind = None if is_py_dataset(fit.x) else not_in_memory(fit.x)
    if kind is not None:  # named first: dropping steps_per_epoch or the like would not make it trainable
        raise NbdistError(pipeline_message(kind, "training data x"))
    check_fit_arguments(fit)
    check_trainable(model, built=False)  # a model without an input shape is built on the data, as fit does
    check_not_stateful(model)
    train_set, val_set = fit_data(fit)
    _build_on(model, train_set)
    check_built(model)
    check_fits_model(model, train_set, val_set)
    run = prepare_fit_run(model, fit, config.epochs, global_batch, len(train_set))
    return _job(model, config, train_set, val_set, namespace, listeners, fit, run)


def fit_job(model: Any, config: TrainConfig, fit: FitCall, explicit: dict[str, Any], lr_scaling_given: bool,
            namespace: dict[str, Any] | None = None) -> TrainingJob:
    """A job for a cell's ``model.fit(...)`` (``%%dist_train``, a trial of ``%%dist_tune``): its arguments
    agreed with the magic line's ``explicit`` options, then checked as every in-memory run is."""
    fit, config = loaders_split(fit, config)
    if is_generator(fit.x) or is_generator(fit.validation_data):  # drawn for the fit's epochs: the magic's first
        if "batch_size" in explicit and is_generator(fit.x):
            raise NbdistError("a generator makes its own batches: drop --batch-size from the magic line (each of "
                              "its batches is a global batch, split over the workers).")
        if "epochs" in explicit and "epochs" not in fit.given:
            fit = fit.replace(epochs=explicit["epochs"])
    if reads_once(fit):  # read first: its batch is the global batch
        fit = fit_from_pipelines(fit)
    changes, global_batch = fit_plan(fit, explicit, lr_scaling_given)
    return prepare_fit(model, config.replace(**changes), fit, global_batch, namespace)


def loaders_split(fit: FitCall, config: TrainConfig) -> tuple[FitCall, TrainConfig]:
    """A torch DataLoader over a map-style dataset split by index over the run's workers (data/torch_loaders.py):
    its batch is the global batch, in its sampler's order (nbdist shuffles nothing more, scales no rate). The
    run's world is decided here, as for every run (``resolve_world``): no more workers than a loader's batch
    or the training rows."""
    if not is_split_loader(fit.x) and not is_split_loader(fit.validation_data):
        return fit, config
    from .driver.resolve import resolve_backend, resolve_world

    # The loaders' batches and the training rows; arrays beside a validation loader bound the world as the run
    # will bound it (TrainingJob._world_limits), so that the loader is split for the run's workers.
    batches = [int(v.batch_size) for v in (fit.x, fit.validation_data) if is_split_loader(v) and v.batch_size]
    if is_split_loader(fit.x):
        rows = len(fit.x.dataset)
    else:
        first = next(iter(fit.x.values()), None) if isinstance(fit.x, dict) else fit.x
        first = first[0] if isinstance(first, (list, tuple)) and first else first
        rows = len(first) if hasattr(first, "__len__") else 0
        batches += [int(fit.batch_size)] if fit.batch_size else []
    world, _ = resolve_world(config, resolve_backend(config), {"batch": min(batches, default=0), "rows": rows})
    config = config.replace(workers=world)
    seed = config.seed if config.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    changes: dict[str, Any] = {"lr_scaling": "none"} if config.lr_scaling == "auto" else {}
    if is_split_loader(fit.x):
        changes["shuffle"] = False
    return split_loaders(fit, world, seed), config.replace(**changes)


def check_training_line(config: TrainConfig, x: Any, y: Any, features: str | list[str] | None, label: str | None,
                        cell_source: str, weight_col: str | None = None) -> None:
    """What ``%%dist_train`` can refuse before its cell runs, so a typo costs nothing: the ``--data``
    (Spark: its schema only), the backend, MLflow, and a cell that trains with its own loop."""
    from .driver.resolve import resolve_backend

    if x is not None:
        training_data(x, y, features, label, weight_col)
    elif weight_col is not None:  # the cell's own model.fit takes in-memory data: its weights are sample_weight
        no_columns(None, None, weight_col)
    resolve_backend(config)  # e.g. --backend spark with no SparkContext
    wanted(config.mlflow)  # --mlflow without MLflow installed
    check_no_custom_loop(cell_source)  # a hand-written loop would run in full before anything could tell


def labels_in_batches(x: Any) -> bool:
    """Whether ``x`` carries its labels itself (Spark data, a PyDataset, an input pipeline), as evaluate takes it."""
    return is_spark_data(x) or is_py_dataset(x) or is_pipeline(x)


def spark_validation_data(validation_data: Any) -> bool:
    """Whether ``validation_data`` is a Spark DataFrame or RDD, alone or first in a tuple."""
    first = validation_data[0] if isinstance(validation_data, (tuple, list)) and validation_data else validation_data
    return is_spark_data(first)


def spark_in_fit(x: Any, validation_data: Any) -> None:
    """Spark data where ``model.fit``'s in-memory data goes: one sentence naming the way that takes it.
    Keras' fit has no arguments that name a DataFrame's columns, so Spark data is named on the magic line."""
    if is_spark_data(x):
        raise NbdistError("model.fit(...) takes in-memory data; a Spark DataFrame or RDD trains where it lies with "
                          "--data df --features COLS --label COL on the magic line (the cell only builds and "
                          "compiles the model), or nbdist.train(model, df, features=..., label=...).")
    if spark_validation_data(validation_data):
        raise NbdistError("a Spark DataFrame as validation data needs a training DataFrame (both are streamed "
                          "from the executors); with in-memory training data pass in-memory validation data, "
                          "e.g. val_df.toPandas() for a small one.")


def _job(model: Any, config: TrainConfig, train_set: Any, val_set: Any, namespace: dict[str, Any] | None,
         listeners: list[Any] | None, fit: FitCall | None = None, fit_run: Any = None) -> TrainingJob:
    strategy, notice = chosen_strategy(model, config.strategy)
    for line in (notice, other_distribution(model)):
        if line is not None:
            log.warning("%s", line)
    config = config.replace(strategy=strategy)
    renderer = make_renderer(config.ui)
    all_listeners = list(listeners or []) + ([renderer] if renderer else [])
    job = TrainingJob(model, config, train_set, val_set, namespace, all_listeners)
    job.fit = fit_run
    if hasattr(renderer, "attach"):
        renderer.attach(job)
    track(job, config, fit)  # MLflow, when the notebook tracks: one run, logged here
    return job


def _build_on(model: Any, train_set: Any) -> None:
    """Every weight created on the training data's first rows, as ``fit``'s first step would."""
    if isinstance(train_set, FitData):
        ensure_built(model, train_set.x, train_set.y)
    elif isinstance(train_set, PyDatasetData) and train_set.first_row:
        row = train_set.first_row
        ensure_built(model, row[0], row[1] if len(row) > 1 else None)


def training_data(x: Any, y: Any, features: str | list[str] | None = None, label: str | None = None,
                  weight_col: str | None = None) -> Any:
    """In-memory data as FitData (what ``model.fit(x, y)`` takes), Spark data as SparkData (left on the executors)."""
    x, _ = named_frames(x, None, features, label)
    if is_spark_data(x):
        return spark_dataset(x, y, features, label, weight_col=weight_col)
    no_columns(features, label, weight_col)
    if is_py_dataset(x):
        return make_py_dataset_data(x, "training data")
    if is_split_loader(x):  # split by index over the workers, when the fit's arguments are (loaders_split)
        return None
    if is_pipeline(x):  # read once, when the fit's arguments are (pipelines.fit_from_pipelines)
        return check_any(x, "the training data x")
    return make_fit_data(x, y, what="training data")


__all__ = ["FitCall", "TrainingJob", "check_training_line", "evaluate", "fit_arguments", "fit_job", "intercept_fit",
           "is_keras_model", "is_spark_data", "labels_in_batches", "named_frames", "predict", "prepare", "prepare_fit",
           "train", "training_data"]
