"""``Search``: the trials run as nbdist jobs, several at once, pumped on the notebook's thread and
pruned on merged metrics.

Everything happens on the calling (notebook's main) thread, which pumps every running trial's events in
turn: a trial's merged epoch is reported to Optuna there (``trial.report``), and when its pruner says so
that trial's workers are stopped at once, freeing its slot for the next trial. The study lives in Optuna's
storage (an SQLite file by default), so an interrupted search resumes where it was: finished trials count
towards ``trials`` and are not run again. An interrupt stops every trial's workers and marks those trials
failed (``nbdist_interrupted``), leaving no trial RUNNING.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from ..driver.interrupts import interrupts_held, interrupts_noted
from ..driver.search_state import SearchState, TrialRow
from ..driver.state import TERMINAL
from ..errors import NbdistError
from ..fit_arguments import FitCall
from ..model.spec import is_keras_model
from .study import INTERRUPTED, MODEL_ATTR, check_count, finished_before

log = logging.getLogger(__name__)

# Seconds the loop waits on each running trial's events per turn.
PUMP_SLICE = 0.05


class FitCaptured(BaseException):
    """Raised out of the trial cell's ``model.fit(...)``: its arguments are the trial's run. A BaseException
    (as KeyboardInterrupt is): keras-tuner's search, and any cell's ``except Exception:`` around its fit,
    must let it through."""

    def _render_traceback_(self) -> list[str]:  # IPython shows nothing: this is how the cell hands over
        return []


@dataclass
class TrialRun:
    trial: Any
    job: Any
    row: TrialRow
    slot: int  # its share of the machine's cores while it runs (TrainConfig.local_slot)
    fit: FitCall | None = None  # the cell's model.fit arguments (None: trained on --data)
    prune: bool = False


class Search:
    """A running or finished search: ``.study``, ``.best_model``, ``.best_params``, ``.state``, ``.jobs``."""

    def __init__(self, build: Callable[[Any], Any], *, study: Any, optuna: Any, n_trials: int, parallel: int,
                 objective: str, config: TrainConfig, x: Any = None, y: Any = None,
                 validation_data: tuple[Any, Any] | None = None, explicit: dict[str, Any] | None = None,
                 lr_scaling_given: bool = False, namespace: dict[str, Any] | None = None,
                 listeners: list[Callable[[str, SearchState, Any], None]] | None = None,
                 mlflow_run: Any = None, models_dir: Path | None = None, ensemble_size: int | None = None) -> None:
        self.build = build
        self.models_dir = models_dir
        self.study = study
        self._optuna = optuna
        self.objective = objective
        self.config = config
        self.x, self.y, self.validation_data = x, y, validation_data
        self.explicit = dict(explicit or {})
        self.lr_scaling_given = lr_scaling_given
        self.namespace = namespace
        self.listeners = list(listeners or [])
        self.mlflow_run = mlflow_run
        direction = study.direction.name.lower()
        self.state = SearchState(objective, direction, n_trials, parallel, previous=finished_before(optuna, study))
        self._seed_best()
        self.running: dict[int, TrialRun] = {}
        self.jobs: dict[int, Any] = {}  # every trial's TrainingJob of this session, by trial number
        self.best_model: Any = None
        self.best_number: int | None = None  # the trial best_model comes from
        self.ensemble_size = ensemble_size
        self.best_ensemble: Any = None  # with ensemble_size: the best trials' models averaged, once the search is done
        self._error: str | None = None
        self._asked: Any = None  # a trial asked of the study and not yet running (told failed if the search stops)

    def _seed_best(self) -> None:
        try:
            best = self.study.best_trial
        except ValueError:  # no complete trial yet
            return
        self.state.best_value, self.state.best_number = best.value, best.number
        self.state.previous_best = best.value

    @property
    def best_params(self) -> dict[str, Any]:
        try:
            return dict(self.study.best_params)
        except ValueError:
            return {}

    # -- the loop -------------------------------------------------------
    def run(self) -> Search:
        """Run trials until the study has ``n_trials`` finished ones. Raises what ended it early
        (KeyboardInterrupt after stopping every trial's workers, NbdistError for a bad cell)."""
        self._notify("start")
        try:
            with interrupts_noted() as pressed:  # acted on between the trials' steps: never lost (driver/interrupts.py)
                self._warm_trials()
                self._loop(pressed)
        except BaseException as exc:
            interrupted = isinstance(exc, KeyboardInterrupt)
            self._stop_all("interrupted" if interrupted else "the search failed")
            message = "" if interrupted else str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.state.finish("interrupted" if interrupted else "failed", message)
            self._end()
            raise
        self.state.finish("done")
        self._end()
        return self

    def _remaining(self) -> int:
        done = self.state.previous + sum(self.state.count(s) for s in ("complete", "pruned", "failed"))
        return self.state.n_trials - done - len(self.running)

    def _warm_trials(self) -> None:
        """Local trials fork their workers from a fork server started (or kept) now with their own
        startup environment, the thread budget of ``parallel`` trials sharing the machine, so that
        none of them waits for TensorFlow's import (backends/warm.py)."""
        from ..driver.resolve import runs_locally

        if runs_locally(self.config) and self.config.warm_workers:
            from ..backends.local import start_warm_workers

            start_warm_workers(self.state.parallel * (self.config.workers or 1))

    def _free_slot(self) -> int:
        """The lowest share of the machine no running trial holds."""
        return min(set(range(self.state.parallel)) - {tr.slot for tr in self.running.values()})

    def _loop(self, pressed: list[int]) -> None:
        while True:
            if pressed:
                raise KeyboardInterrupt
            while len(self.running) < self.state.parallel and self._remaining() > 0:
                self._start_next()
            if not self.running:
                return
            for number in list(self.running):
                tr = self.running[number]
                if tr.job.status not in TERMINAL:
                    tr.job.pump(PUMP_SLICE)
                if self._error is not None:
                    raise NbdistError(self._error)
                if tr.prune and tr.job.status not in TERMINAL:
                    tr.job.stop("pruned")  # its workers end now; the slot goes to the next trial
                if tr.job.status in TERMINAL:
                    self._finish(number)

    def _start_next(self) -> None:
        # A trial asked for is always one this search will tell (running, or failed) and shows: an interrupt
        # held to the end of this block finds it asked and in the run state (_stop_all ends both).
        with interrupts_held(defer=True):
            trial = self._asked = self.study.ask()
            number = trial.number
            row = self.state.trial_started(number, {}, self.config.epochs)
        job = None
        slot = self._free_slot()
        try:
            job, fit = self._build_job(trial, slot)
            row.params, row.epochs = dict(trial.params), job.config.epochs
            tr = TrialRun(trial, job, row, slot, fit)
            self._track(tr)  # the MLflow run logs each epoch before the pruner may end the trial on it
            job.listeners.append(self._epoch_listener(tr))
            job.start()
        except BaseException as exc:
            with interrupts_held():
                if job is not None and job.state is not None:  # cut short while launching: end what started
                    job.stop("the search stopped")
                self._asked = None
                self._tell_failed(trial, f"{type(exc).__name__}: {exc}",
                                  interrupted=isinstance(exc, KeyboardInterrupt))
                self.state.trial_ended(number, "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed",
                                       error=str(exc))
                self._notify("trial", number)
            raise
        with interrupts_held(defer=True):
            self.running[number] = tr
            self.jobs[number] = job
            self._asked = None
        self._notify("trial", number)

    def _build_job(self, trial: Any, slot: int) -> tuple[Any, FitCall | None]:
        """Run the trial's cell (or function) up to its model.fit, and make the job it asks for."""
        from ..driver.fit_call import intercept_fit

        captured: list[tuple[Any, FitCall]] = []

        def on_fit(model: Any, fit: FitCall) -> Any:
            captured.append((model, fit))
            raise FitCaptured()

        with intercept_fit(on_fit) as outcome:
            try:
                model = self.build(trial)
            except FitCaptured:
                model = None
        if outcome.aborted:  # an interrupt while the cell ran
            raise outcome.aborted[0]
        if captured:
            model, fit = captured[0]
            return self._fit_job(model, fit, slot), fit
        return self._data_job(model, slot), None

    def _trial_config(self, slot: int, **changes: Any) -> TrainConfig:
        # Trials draw nothing themselves and log through the search's MLflow run (tracking below).
        # Local trials running at once split the machine: each its own cores and thread budget.
        return self.config.replace(ui="none", background=False, mlflow=False, local_share=self.state.parallel,
                                   local_slot=slot, **changes)

    def _fit_job(self, model: Any, fit: FitCall, slot: int) -> Any:
        from ..api import fit_job

        return fit_job(model, self._trial_config(slot), fit, self.explicit, self.lr_scaling_given, self.namespace)

    def _data_job(self, model: Any, slot: int) -> Any:
        from ..api import prepare

        if not is_keras_model(model):
            raise NbdistError("the trial built no model to train: the cell must call model.fit(...), or assign "
                              "(the API: return) a compiled Keras model and name the data with --data X,y.")
        if self.x is None:
            raise NbdistError("the trial's cell calls no model.fit(...), so name the data to train on: --data X,y "
                              "(the API: x=..., y=...).")
        return prepare(model, self._trial_config(slot), self.x, self.y, self.validation_data, namespace=self.namespace)

    def _epoch_listener(self, tr: TrialRun) -> Callable[[str, Any, Any], None]:
        from ..ui.tracking import metric_step

        def on_event(kind: str, state: Any, merged: Any) -> None:
            if kind == "worker" and all(w.pid is not None for w in state.workers):
                self.state.trial_ready(tr.row.number)
            if kind != "epoch" or self._error is not None or tr.prune:
                return
            value = merged.get(self.objective)
            if value is None:
                self._error = (f"--objective {self.objective} is not a metric of these runs (their epochs log "
                               f"{', '.join(sorted(merged))}); name one of them.")
                return
            self.state.trial_epoch(tr.row.number, float(value))
            tr.trial.report(float(value), metric_step(state))
            if tr.trial.should_prune():
                tr.prune = True
                tr.job.end_pump()  # the loop stops its workers before any later epoch is handled
            self._notify("epoch", tr.row.number)

        return on_event

    def _track(self, tr: TrialRun) -> None:
        if self.mlflow_run is None or self.mlflow_run.run_id is None:
            return
        from ..ui.tracking import RunTracker, run_params

        params = run_params(tr.job.config, tr.job.model, tr.fit)
        for key, value in tr.trial.params.items():
            params[key if key not in params else f"trial.{key}"] = str(value)
        tracker = RunTracker(params, run_name=f"trial {tr.row.number}", parent_run_id=self.mlflow_run.run_id,
                             tags={"optuna.study": self.study.study_name, "optuna.trial": str(tr.row.number)})
        tracker.attach(tr.job)
        tr.job.listeners.append(tracker)

    # -- endings --------------------------------------------------------
    def _finish(self, number: int) -> None:
        with interrupts_held(defer=True):  # taken from the running trials and told, or neither
            self._finish_held(number)

    def _finish_held(self, number: int) -> None:
        tr = self.running.pop(number)
        job, states = tr.job, self._optuna.trial.TrialState
        tr.row.worker_pids = [w.pid for w in job.state.workers if w.pid is not None]
        if tr.prune:  # also when its last epoch was already queued: the pruner decided on a reported step
            self.study.tell(tr.trial, state=states.PRUNED)
            self.state.trial_ended(number, "pruned")
        elif job.status == "done":
            values = job.history.get(self.objective) or []
            value = float(values[-1]) if values else math.nan
            if math.isnan(value) or math.isinf(value):
                self._tell_failed(tr.trial, f"{self.objective} was {value} at the last epoch")
                self.state.trial_ended(number, "failed", error=f"{self.objective} was {value}")
            else:
                self._save_model(tr.trial, job.model)
                self.study.tell(tr.trial, value)
                self.state.trial_ended(number, "complete", value)
                self._follow_study_best()
        else:  # a worker died or raised: the trial failed, the search goes on
            err = job.error
            message = str(err) if err is not None else job.state.error or job.status
            self._tell_failed(tr.trial, message, traceback=getattr(err, "worker_traceback", "") or "")
            self.state.trial_ended(number, "failed", error=message)
            log.warning("trial %d failed: %s", number, message)
        self._notify("trial", number)

    def _follow_study_best(self) -> None:
        """The study names the best trial, ties included (its storage breaks them, not the order in which
        trials finished here): ``best_model`` is always that trial's model, or None until ``_end`` loads it
        when it ran in an earlier session."""
        try:
            best = self.study.best_trial
        except ValueError:  # no complete trial
            return
        except Exception:  # the storage failed: the search's own ending is what matters
            log.exception("could not read the study's best trial")
            return
        self.state.best_value, self.state.best_number = best.value, best.number
        if best.number == self.best_number:
            return
        job = self.jobs.get(best.number)
        if job is not None and job.status == "done":
            self.best_model, self.best_number = job.model, best.number
        else:
            self.best_model, self.best_number = None, None

    def _tell_failed(self, trial: Any, message: str, traceback: str = "", interrupted: bool = False) -> None:
        try:
            trial.set_user_attr("error", message[:1000])
            if traceback:
                trial.set_user_attr("traceback", traceback[-4000:])
            if interrupted:
                trial.set_user_attr(INTERRUPTED, True)
            self.study.tell(trial, state=self._optuna.trial.TrialState.FAIL)
        except Exception:  # the storage itself failed: said once, the search's ending is what matters
            log.exception("could not record trial %d's failure in the study", trial.number)

    def _stop_all(self, reason: str) -> None:
        """Every running trial's workers stopped, and the trial told failed (interrupted) in the storage."""
        with interrupts_held():
            if self._asked is not None:  # asked for, not yet running: told failed all the same
                trial, self._asked = self._asked, None
                self._tell_failed(trial, f"stopped: {reason}", interrupted=True)
                self.state.trial_ended(trial.number, "interrupted", error=reason)
            for number in list(self.running):
                tr = self.running.pop(number)
                try:
                    tr.job.stop(reason)
                except Exception:
                    log.exception("stopping trial %d failed", number)
                tr.row.worker_pids = [w.pid for w in tr.job.state.workers if w.pid is not None]
                self._tell_failed(tr.trial, f"stopped: {reason}", interrupted=True)
                self.state.trial_ended(number, "interrupted", error=reason)
                self._notify("trial", number)

    def _save_model(self, trial: Any, model: Any) -> None:
        """The complete trial's trained model as a .keras file, named in its user attributes, so that a
        resumed search's ``best_model`` is there when the best trial ran in an earlier session."""
        if self.models_dir is None:
            return
        path = self.models_dir / f"trial-{trial.number}.keras"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            model.save(path)
            trial.set_user_attr(MODEL_ATTR, str(path))
        except Exception as exc:  # a model Keras cannot save (a custom layer without get_config, a full disk)
            log.warning("trial %d's model could not be saved to %s (%s: %s); a resumed search will not have it",
                        trial.number, path, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")

    def _load_best_model(self) -> None:
        """The best trial ran in an earlier session: its saved model, if it was saved."""
        try:
            best = self.study.best_trial
        except ValueError:
            return
        model = self._load_trial_model(best)
        if model is not None:
            self.best_model, self.best_number = model, best.number

    def ranked_models(self, n: int) -> list[tuple[int, Any]]:
        """The trained models of the best ``n`` complete trials, best first, as (trial number, model): this
        session's from their runs, earlier sessions' loaded from their saved files (a trial whose model was not
        saved, or no longer loads, is passed over with a log line)."""
        states = self._optuna.trial.TrialState
        complete = [t for t in self.study.get_trials(deepcopy=False, states=(states.COMPLETE,))
                    if t.value is not None and not math.isnan(t.value)]
        sign = -1.0 if self.state.direction == "maximize" else 1.0
        complete.sort(key=lambda t: (sign * t.value, t.number))
        out: list[tuple[int, Any]] = []
        for trial in complete:
            if len(out) == n:
                break
            job = self.jobs.get(trial.number)
            if job is not None and job.status == "done":
                out.append((trial.number, job.model))
                continue
            if trial.number == self.best_number and self.best_model is not None:  # loaded already, at the end
                out.append((trial.number, self.best_model))
                continue
            model = self._load_trial_model(trial)
            if model is not None:
                out.append((trial.number, model))
        return out

    def ensemble(self, n: int) -> Any:
        """One Keras model averaging the predictions of the best ``n`` trials' models (soft voting for a
        classifier), compiled as the best one is (``nbdist.model.ensemble``)."""
        from ..model.ensemble import make_ensemble

        check_count("--ensemble", n, 3)
        ranked = self.ranked_models(n)
        if len(ranked) < n:
            log.warning("the ensemble has %d member(s), not %d: only %d complete trial(s) have a trained model",
                        len(ranked), n, len(ranked))
        return make_ensemble([model for _, model in ranked], name=f"ensemble_of_{len(ranked)}")

    def _load_trial_model(self, trial: Any) -> Any:
        path = trial.user_attrs.get(MODEL_ATTR)
        if not path:
            log.info("trial %d ran in an earlier session without saving its model", trial.number)
            return None
        import keras

        try:
            return keras.models.load_model(path)
        except Exception as exc:  # moved or deleted, or a custom object not importable here
            log.warning("trial %d's model could not be loaded from %s (%s: %s)", trial.number, path,
                        type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            return None

    def _end(self) -> None:
        self._follow_study_best()
        if self.state.best_number is not None and self.best_model is None:
            self._load_best_model()
        if self.ensemble_size and self.state.status == "done" and self.state.best_number is not None:
            self.best_ensemble = self.ensemble(self.ensemble_size)
        if self.mlflow_run is not None:
            self.mlflow_run.end(self.state.status, self.state.best_value, self.best_params)
        self._notify("end")

    def _notify(self, kind: str, payload: Any = None) -> None:
        for listener in self.listeners:
            try:
                listener(kind, self.state, payload)
            except Exception:  # a broken view must not break the search
                log.exception("search listener failed")
