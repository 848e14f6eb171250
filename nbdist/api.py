"""The Python API under the magics: ``train()`` and ``TrainingJob``."""
from __future__ import annotations

from typing import Any

from .checks import check_model_fits_data, check_not_stateful, check_text_inputs
from .config import TrainConfig
from .data import make_dataset
from .driver.inference import evaluate, predict  # noqa: F401 - the API under %dist_evaluate / %dist_predict
from .driver.training import TrainingJob
from .errors import NbdistError
from .fitdata import is_py_dataset
from .model_io import check_trainable, ensure_built
from .spark.data import SparkData, is_spark_data, spark_dataset
from .tracking import track
from .ui import make_renderer


def train(model: Any, x: Any, y: Any = None, *, validation_data: tuple[Any, ...] | None = None,
          callbacks: list[Any] | None = None, class_weight: dict[Any, float] | None = None,
          sample_weight: Any = None, validation_split: float = 0.0, initial_epoch: int = 0,
          namespace: dict[str, Any] | None = None, features: str | list[str] | None = None,
          label: str | None = None, **options: Any) -> TrainingJob:
    """Train ``model`` data-parallel on ``x``/``y`` and put the trained weights back into it.

    Options are the fields of ``TrainConfig`` (epochs, batch_size, workers, strategy,
    backend, averaging_frequency, seed, shuffle, ui, background, ...). Blocks until
    training ends unless ``background=True``; returns the ``TrainingJob`` either way.
    The API is silent by default (``ui="none"``). ``x`` may be a Spark DataFrame (name its
    columns with ``features`` and ``label``) or an RDD of (features, label) pairs: each Spark
    task then reads its own partition on its executor.

    ``callbacks``, ``class_weight``, ``sample_weight``, ``validation_split``, ``validation_data``
    (2- or 3-tuples), ``initial_epoch`` and ``x``/``y`` as dicts or lists of arrays mean what they
    mean in ``model.fit``: callbacks run here with the merged metrics (``job.fit_history`` is
    their ``keras.callbacks.History``). ``batch_size`` stays per worker: every global batch of
    ``batch_size * workers`` rows is split over the workers.
    """
    unknown = set(options) - TrainConfig.field_names()
    if unknown:
        raise NbdistError(f"unknown option(s) {', '.join(sorted(unknown))}; see help(nbdist.TrainConfig).")
    options.setdefault("ui", "none")
    fit_style = (callbacks is not None or class_weight is not None or sample_weight is not None
                 or bool(validation_split) or bool(initial_epoch) or isinstance(x, (dict, list, tuple))
                 or isinstance(y, (dict, list, tuple)) or is_py_dataset(x) or is_py_dataset(validation_data)
                 or (isinstance(validation_data, (tuple, list)) and len(validation_data) == 3))
    config = TrainConfig(**options)
    if fit_style:
        if is_spark_data(x):
            raise NbdistError("callbacks, class_weight, sample_weight, validation_split and initial_epoch need "
                              "in-memory data (numpy or pandas); a Spark DataFrame trains without them.")
        fit = {"x": x, "y": y, "batch_size": None, "epochs": config.epochs, "callbacks": callbacks,
               "validation_split": validation_split, "validation_data": validation_data,
               "shuffle": config.shuffle, "class_weight": class_weight, "sample_weight": sample_weight,
               "initial_epoch": initial_epoch, "steps_per_epoch": None, "validation_steps": None,
               "validation_freq": 1}
        job = prepare_fit(model, config, fit, None, namespace)
    else:
        job = prepare(model, config, x, y, validation_data, namespace, features=features, label=label)
    job.start()
    if config.background:
        return job.run_in_background()
    job.wait()
    return job


def prepare(model: Any, config: TrainConfig, x: Any, y: Any, validation_data: tuple[Any, Any] | None,
            namespace: dict[str, Any] | None = None, listeners: list[Any] | None = None,
            features: str | list[str] | None = None, label: str | None = None) -> TrainingJob:
    """Check the inputs and build a job, not yet started: nothing has touched the model."""
    train_set = training_data(x, y, features, label)
    val_set = None
    if validation_data is not None:
        if not isinstance(validation_data, (tuple, list)) or len(validation_data) != 2:
            raise NbdistError("validation_data must be a pair (X_val, y_val).")
        if is_spark_data(validation_data[0]):
            raise NbdistError("validation data must be numpy or pandas (a Spark DataFrame is not supported "
                              "for validation yet); collect a small sample, e.g. df.limit(1000).toPandas().")
        val_set = make_dataset(validation_data[0], validation_data[1], "validation data")
        if isinstance(train_set, SparkData):
            pass  # feature width is only known on the executors; the worker's fit checks it
        elif val_set.x.shape[1:] != train_set.x.shape[1:]:
            raise NbdistError(f"validation features have shape {val_set.x.shape[1:]} per row but training "
                              f"features have {train_set.x.shape[1:]}; pass matching arrays.")
    check_not_stateful(model)
    if not isinstance(train_set, SparkData):  # a mismatch is one sentence here, not a worker's traceback
        check_trainable(model)
        ensure_built(model, train_set.x, train_set.y)
        check_model_fits_data(model, train_set.x, train_set.y)
        if val_set is not None:
            check_model_fits_data(model, val_set.x, val_set.y, "validation data")
    elif getattr(model, "compiled", False):
        # The rows are on the executors, but a model built with build(shape) must have every weight
        # here too: the workers' weights come back into it.
        ensure_built(model, None, None)
    renderer = make_renderer(config.ui)
    all_listeners = list(listeners or []) + ([renderer] if renderer else [])
    job = TrainingJob(model, config, train_set, val_set, namespace, all_listeners)
    if hasattr(renderer, "attach"):
        renderer.attach(job)
    track(job, config)  # MLflow, when the notebook tracks: one run, logged here
    return job


def prepare_fit(model: Any, config: TrainConfig, fit: dict[str, Any], global_batch: int | None,
                namespace: dict[str, Any] | None = None, listeners: list[Any] | None = None) -> TrainingJob:
    """A job for one ``model.fit(...)``'s arguments (driver/fit_call.py), not yet started."""
    from .driver.fit_call import check_fit_arguments, fit_data, prepare_fit_run

    check_fit_arguments(fit)
    check_trainable(model)
    check_not_stateful(model)
    train_set, val_set = fit_data(fit)
    for data, what in ((train_set, "training data"), (val_set, "validation data")):
        check_text_inputs(model, getattr(data, "x", None), what)
    renderer = make_renderer(config.ui)
    all_listeners = list(listeners or []) + ([renderer] if renderer else [])
    job = TrainingJob(model, config, train_set, val_set, namespace, all_listeners)
    job.fit = prepare_fit_run(model, fit, config.epochs, global_batch, len(train_set))
    if hasattr(renderer, "attach"):
        renderer.attach(job)
    track(job, config, fit)  # MLflow, when the notebook tracks: one run, logged here
    return job


def training_data(x: Any, y: Any, features: str | list[str] | None = None, label: str | None = None) -> Any:
    """Numpy/pandas data as a Dataset, Spark data as SparkData (left on the executors)."""
    if is_spark_data(x):
        return spark_dataset(x, y, features, label)
    if features is not None or label is not None:
        raise NbdistError("--features and --label name the columns of a Spark DataFrame; with numpy or "
                          "pandas data pass --data X,y instead.")
    return make_dataset(x, y, "training data")
