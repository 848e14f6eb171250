"""``tune`` and ``make_search``: a search's options checked once, at the door."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from ..config import TrainConfig, implied_strategy
from ..driver.search_state import SearchState
from ..errors import NbdistError
from .scheduler import Search
from .study import (
    DEFAULT_TRIALS,
    DIRECTIONS,
    check_count,
    import_optuna,
    infer_direction,
    make_pruner,
    models_dir_for,
    open_study,
)

log = logging.getLogger(__name__)



def tune(build: Callable[[Any], Any], **kwargs: Any) -> Search:
    """Search hyperparameters with Optuna, ``parallel`` trials at once, each an nbdist run.

    ``build(trial)`` builds and compiles a model using ``trial.suggest_*``, then either calls
    ``model.fit(...)`` (that call is the trial's run: its arguments, callbacks and all; the
    function stops there) or returns the model (trained on ``x``/``y`` with the options).
    Keyword arguments: ``trials`` (DEFAULT_TRIALS, 10, said in a first line), ``parallel`` (2),
    ``objective`` ("val_loss"; a merged metric, its value at the last epoch is the trial's value),
    ``direction`` ("maximize" or "minimize"; default: minimize a loss or error, else maximize),
    ``workers_per_trial`` (1),
    ``pruner`` ("median" by default, "percentile", "hyperband", "successive-halving", "none", or an
    Optuna pruner: it may stop a trial after any epoch), ``sampler``, and the study: ``study``, else
    ``study_name`` in ``storage`` (an RDB URL, default ``sqlite:///nbdist_tune.db``), loaded when it
    exists so that an interrupted search resumes (``trials`` counts the study's finished trials).
    Other options are TrainConfig's (epochs, batch_size, strategy, backend, seed, mlflow, run_name,
    ...; ``ui`` draws the table of trials, "none" by default). Each complete trial's trained model is
    saved as ``trial-<n>.keras`` in ``models_dir`` (default: ``<db>_models/<study>/`` beside an SQLite
    storage's file, ``nbdist_tune_models/<study>/`` otherwise; False saves none; a passed ``study`` saves
    only with ``models_dir``), so that a resumed search loads its best model. Returns the ``Search``:
    ``.study``, ``.best_model`` (the best trial's trained model, loaded from its file when it ran in an
    earlier session), ``.best_params``; with ``ensemble=N``, ``.best_ensemble``: one Keras model averaging
    the predictions of the best N trials' models (soft voting for a classifier; ``nbdist.model.ensemble``), which
    evaluates, predicts, saves and loads like any model (``.ensemble(n)`` makes one of another size).
    """
    return make_search(build, **kwargs).run()


def make_search(build: Callable[[Any], Any], *, trials: int | None = None, parallel: int = 2,
         objective: str = "val_loss", direction: str | None = None, workers_per_trial: int = 1,
         storage: str | None = None,
         study_name: str | None = None, study: Any = None, pruner: Any = None, sampler: Any = None,
         x: Any = None, y: Any = None, validation_data: tuple[Any, Any] | None = None,
         namespace: dict[str, Any] | None = None,
         listeners: list[Callable[[str, SearchState, Any], None]] | None = None,
         explicit: dict[str, Any] | None = None, lr_scaling_given: bool = False,
         models_dir: str | os.PathLike | bool | None = None, ensemble: int | None = None, **options: Any) -> Search:
    """The search ``tune`` runs, checked and its study opened, not started."""
    optuna = import_optuna()
    study_given = study is not None
    if trials is None:
        trials = DEFAULT_TRIALS
        log.warning("no --trials given: the study runs until it has %d finished trials (add --trials N to "
                    "choose; a rerun with a larger N continues it)", trials)
    if ensemble is not None:
        check_count("--ensemble", ensemble, 3)
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise NbdistError(f"--trials must be a whole number of at least 1, got {trials!r}; for example --trials 20.")
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise NbdistError(f"--parallel must be a whole number of at least 1, got {parallel!r}; "
                          "for example --parallel 2.")
    if not isinstance(objective, str) or not objective.strip():
        raise NbdistError("--objective must name a metric the runs log, e.g. --objective val_accuracy.")
    if direction is None:
        direction = study.direction.name.lower() if study is not None else infer_direction(objective)
    if direction not in DIRECTIONS:
        raise NbdistError(f"--direction {direction!r}: use maximize or minimize.")
    unknown = set(options) - TrainConfig.field_names()
    if unknown:
        raise NbdistError(f"unknown option(s) {', '.join(sorted(unknown))}; see help(nbdist.TrainConfig).")
    if "workers" in options:
        raise NbdistError("a search sets each trial's workers with workers_per_trial (--workers-per-trial), "
                          "not workers.")
    ui = options.pop("ui", "none")
    if explicit is None:  # the API's epochs / batch_size must agree with a fit call's, as on a magic line
        explicit = {k: options[k] for k in ("epochs", "batch_size") if k in options}
    config = TrainConfig(**implied_strategy(options), workers=workers_per_trial)
    from ..ui.tracking import SearchRun, wanted

    tracked = wanted(config.mlflow)
    study = open_study(optuna, study=study, storage=storage, study_name=study_name, direction=direction,
                       sampler=sampler, pruner=make_pruner(optuna, pruner), seed=config.seed)
    from ..ui import make_search_view

    view = make_search_view(ui)
    mlflow_run = None
    if tracked:
        mlflow_run = SearchRun(config.run_name or study.study_name,
                               {"objective": objective, "direction": direction, "trials": str(trials),
                                "parallel": str(parallel), "workers_per_trial": str(workers_per_trial),
                                "pruner": type(study.pruner).__name__, "sampler": type(study.sampler).__name__},
                               active=config.mlflow_active)
    return Search(build, study=study, optuna=optuna, n_trials=trials, parallel=parallel, objective=objective,
                    config=config, x=x, y=y, validation_data=validation_data, explicit=explicit,
                    lr_scaling_given=lr_scaling_given, namespace=namespace,
                  listeners=[*([view] if view else []), *(listeners or [])], mlflow_run=mlflow_run,
                  models_dir=models_dir_for(storage, study.study_name, models_dir, study_given), ensemble_size=ensemble)
