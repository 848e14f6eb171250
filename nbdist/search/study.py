"""Optuna's side of a search: the study and its storage, pruners, directions and the counts checked at the door."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from ..driver.interrupts import interrupts_held
from ..errors import NbdistError

log = logging.getLogger(__name__)


DEFAULT_STORAGE = "sqlite:///nbdist_tune.db"
DEFAULT_STUDY = "nbdist-tune"
# Trials when none are asked for: keras-tuner's default max_trials, and the random start of Optuna's
# TPE sampler (n_startup_trials=10), so the default is a coarse sweep; a rerun with more continues it.
DEFAULT_TRIALS = 10
DIRECTIONS = ("maximize", "minimize")
PRUNERS = ("median", "percentile", "hyperband", "successive-halving", "none")
INTERRUPTED = "nbdist_interrupted"  # user attribute of a trial an interrupt ended
MODEL_ATTR = "nbdist_model"  # user attribute of a complete trial: the .keras file of its trained model


def import_optuna() -> Any:
    try:
        import optuna
    except ImportError:
        raise NbdistError("a search needs Optuna, which is not installed; pip install 'nbdist[track]' "
                          "(or pip install optuna).") from None
    return optuna


def infer_direction(objective: str) -> str:
    """minimize a loss or an error, maximize anything else (accuracy, AUC, ...)."""
    name = objective.lower()
    return "minimize" if any(w in name for w in ("loss", "error", "crossentropy", "mse", "mae")) else "maximize"


def make_pruner(optuna: Any, spec: Any) -> Any:
    """``median`` (Optuna's MedianPruner, its defaults), ``percentile`` (25th), ``hyperband``,
    ``successive-halving``, ``none``, or a pruner object."""
    if spec is None:
        spec = "median"
    if isinstance(spec, optuna.pruners.BasePruner):
        return spec
    makers = {"median": lambda: optuna.pruners.MedianPruner(),
              "percentile": lambda: optuna.pruners.PercentilePruner(25.0),
              "hyperband": lambda: optuna.pruners.HyperbandPruner(),
              "successive-halving": lambda: optuna.pruners.SuccessiveHalvingPruner(),
              "none": lambda: optuna.pruners.NopPruner()}
    if spec not in makers:
        raise NbdistError(f"unknown pruner {spec!r}; use one of: {', '.join(PRUNERS)}, or an Optuna pruner object "
                          "(a notebook variable's name on the magic line).")
    return makers[spec]()


class HeldStorage:
    """An Optuna storage whose every call is made whole: an interrupt (the kernel's SIGINT) that comes during
    one is raised when it returns (``interrupts_held(defer=True)``; on the main thread only, where Python raises
    it). Cut inside a write, SQLAlchemy leaves SQLite's database locked (Optuna rolls back only on an
    ``Exception``), and the search could then tell none of its running trials failed: they stayed RUNNING in
    the study. Everything else is the wrapped storage's."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def held(*args: Any, **kwargs: Any) -> Any:
            with interrupts_held(defer=True):
                return attr(*args, **kwargs)

        return held


def open_study(optuna: Any, *, study: Any, storage: str | None, study_name: str | None, direction: str,
               sampler: Any, pruner: Any, seed: int | None) -> Any:
    """The given study, or the one named in ``storage`` (made, or loaded to resume) over a ``HeldStorage``.
    A study the user made keeps its own storage."""
    if study is not None:
        if study.direction.name.lower() != direction:
            raise NbdistError(f"the study {study.study_name!r} was made to {study.direction.name.lower()}, "
                              f"not to {direction}; pass --direction {study.direction.name.lower()}.")
        return study
    if sampler is None:
        sampler = optuna.samplers.TPESampler(seed=seed)
    name = study_name or DEFAULT_STUDY
    try:
        # Optuna's own opening of a URL (its trials' cache over the RDB), where this Optuna has it.
        opening = getattr(optuna.storages, "get_storage", optuna.storages.RDBStorage)
        held = HeldStorage(opening(storage or DEFAULT_STORAGE))
        return optuna.create_study(storage=held, study_name=name, direction=direction, sampler=sampler,
                                   pruner=pruner, load_if_exists=True)
    except ValueError as exc:  # e.g. the stored study was made in the other direction
        raise NbdistError(f"the study {name!r} in {storage or DEFAULT_STORAGE} cannot be used: {exc}; "
                          "give another --study name or the stored study's --direction.") from None
    except Exception as exc:  # a storage URL that does not open
        raise NbdistError(f"Optuna's storage {storage or DEFAULT_STORAGE!r} could not be opened "
                          f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); pass an RDB URL such as "
                          "sqlite:///search.db.") from None


def models_dir_for(storage: str | None, study_name: str, models_dir: str | os.PathLike | bool | None,
                   study_given: bool) -> Path | None:
    """Where complete trials' models are saved: ``models_dir`` when given (False: nowhere); by default
    beside an SQLite storage's file (``nbdist_tune.db`` -> ``nbdist_tune_models/<study>/``), else
    ``nbdist_tune_models/<study>/`` in the working directory; nowhere for a study passed in
    without ``models_dir`` (its storage may live in memory only)."""
    if models_dir is False:
        return None
    if models_dir is not None and models_dir is not True:
        return Path(models_dir).expanduser().absolute() / study_name
    if study_given:
        return None
    url = storage or DEFAULT_STORAGE
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        db = Path(url[len("sqlite:///"):].split("?", 1)[0])
        return (db.parent / f"{db.stem}_models").absolute() / study_name
    return Path("nbdist_tune_models").absolute() / study_name


def finished_before(optuna: Any, study: Any) -> int:
    """Trials the study finished earlier: complete, pruned, or failed by themselves (not by an interrupt)."""
    states = optuna.trial.TrialState
    return sum(1 for t in study.get_trials(deepcopy=False)
               if t.state in (states.COMPLETE, states.PRUNED)
               or (t.state == states.FAIL and not t.user_attrs.get(INTERRUPTED)))


def check_count(option: str, value: Any, example: int) -> None:
    """One sentence unless ``value`` is a whole number of at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NbdistError(f"{option} must be a whole number of at least 1, got {value!r}; "
                          f"for example {option} {example}.")
