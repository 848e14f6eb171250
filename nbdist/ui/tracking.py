"""MLflow tracking of a training run: ONE MLflow run per nbdist run, logged from the notebook.

Workers never import MLflow: everything here runs in the notebook, as a run listener
(``tracker(kind, state, payload)``, like the dashboard) fed with the merged per-epoch metrics.
An elastic run (``--workers MIN:MAX``) logs ``workers`` as ``MIN:MAX`` and each change of its
workers as a tag ``nbdist.membership.<i>``; its metrics stay one step per epoch. MLflow is
optional: without it nothing is logged, and asking for it (``--mlflow``) is one
sentence saying what to install. Every MLflow call goes through ``MlflowClient`` with an
explicit run id, never the fluent API, so a run pumped on a background thread logs into the
right run and the notebook's active run is never changed. A tracking server that is down, or
any logging error, costs one warning and turns tracking off for that run; training goes on.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import tempfile
import time
from typing import Any
from urllib.parse import urlparse

from ..config import TrainConfig
from ..errors import NbdistError
from ..fit_arguments import FitCall

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'nbdist[track]' (or pip install mlflow)"
# How long to wait for an HTTP tracking server's port before logging nothing for this run.
PROBE_TIMEOUT = 2.0
# MLflow refuses longer parameter values (6000 characters); long ones are cut to this.
PARAM_CHARS = 500
# Autologging integrations that would otherwise log a Keras fit in the notebook.
KERAS_AUTOLOG = ("keras", "tensorflow")
# How an nbdist ending reads in MLflow.
RUN_STATUS = {"done": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}
# The distributions a logged Keras model needs on each Keras backend, beside Keras itself.
BACKEND_DISTRIBUTIONS = {"tensorflow": ("tensorflow", "tensorflow-cpu"), "jax": ("jax", "jaxlib"),
                         "torch": ("torch",)}


def model_requirements(backend: str) -> list[str] | None:
    """The pip requirements of a Keras model logged from this notebook: Keras and its backend at the versions
    installed here. Given to MLflow, which otherwise infers them by loading the model again in a child process
    (seconds at every run's end); None, for MLflow to infer them, where the backend came from a distribution
    of another name (a nightly, a vendor's build)."""
    from importlib.metadata import PackageNotFoundError, version

    def pinned(name: str) -> str | None:
        try:
            return f"{name}=={version(name)}"
        except PackageNotFoundError:  # e.g. tensorflow-cpu where tensorflow is installed
            return None

    keras_pin = pinned("keras")
    backend_pins = [p for p in map(pinned, BACKEND_DISTRIBUTIONS.get(backend, ())) if p]
    return [keras_pin, *backend_pins] if keras_pin and backend_pins else None


def import_mlflow(required: bool, why: str = "--mlflow") -> Any | None:
    """The mlflow module, or None when it is not installed (``required``: one sentence instead)."""
    try:
        import mlflow
    except ImportError:
        if required:
            raise NbdistError(f"{why} needs MLflow, which is not installed; {INSTALL_HINT}.") from None
        return None
    return mlflow


def keras_autolog_config() -> dict[str, Any] | None:
    """The settings of ``mlflow.autolog()`` / ``mlflow.keras.autolog()`` when either is active."""
    if sys.modules.get("mlflow") is None:
        return None
    try:
        from mlflow.utils.autologging_utils import AUTOLOGGING_INTEGRATIONS, autologging_is_disabled
    except ImportError:
        return None
    for flavor in KERAS_AUTOLOG:
        if not autologging_is_disabled(flavor):
            return dict(AUTOLOGGING_INTEGRATIONS.get(flavor) or {})
    return None


def wanted(setting: bool | None) -> bool:
    """Whether this run is tracked: ``--mlflow`` / ``--no-mlflow``, else whether the notebook uses
    MLflow: a tracking URI set (``mlflow.set_tracking_uri`` or ``MLFLOW_TRACKING_URI``), autologging
    of Keras active, or a run active. A notebook that never imported MLflow pays no import for it."""
    if setting is not None:
        if setting:
            import_mlflow(required=True)
        return bool(setting)
    mlflow = sys.modules.get("mlflow")
    if mlflow is None:
        return bool(os.environ.get("MLFLOW_TRACKING_URI")) and import_mlflow(required=False) is not None
    try:
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set

        uri_set = is_tracking_uri_set()
    except ImportError:  # an MLflow that moved it: the environment variable still says
        uri_set = bool(os.environ.get("MLFLOW_TRACKING_URI"))
    return uri_set or keras_autolog_config() is not None or mlflow.active_run() is not None


def unreachable(uri: str) -> str | None:
    """Why an HTTP tracking server cannot be reached (None: reachable, or not a server)."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        socket.create_connection((parsed.hostname, port), timeout=PROBE_TIMEOUT).close()
    except OSError as exc:
        return f"cannot connect to {parsed.hostname}:{port} ({exc})"
    return None


# -- what a run logs (pure) ------------------------------------------------------------
CONFIG_PARAMS = ("epochs", "batch_size", "strategy", "averaging_frequency", "average_optimizer", "lr_scaling",
                 "seed", "shuffle", "max_restarts", "engine", "checkpoint_dir", "resume")
FIT_PARAMS = ("batch_size", "epochs", "validation_split", "shuffle", "initial_epoch", "class_weight",
              "validation_freq")


def _text(value: Any) -> str:
    text = str(value)
    return text if len(text) <= PARAM_CHARS else text[: PARAM_CHARS - 3] + "..."


def run_params(config: TrainConfig, model: Any, fit: FitCall | None = None) -> dict[str, str]:
    """Parameters of one run: the options (magic line or API), the cell's fit arguments as given
    (``fit.*``; ``fit.batch_size`` is the global batch), the optimizer's config (``optimizer.*``)
    and the model's size. Workers and backend are added once the run knows them."""
    params: dict[str, str] = {}
    for name in CONFIG_PARAMS:
        value = getattr(config, name)
        if value is None or (name == "averaging_frequency" and config.strategy != "averaging"):
            continue
        params[name] = _text(value)
    if fit is not None:
        for name in FIT_PARAMS:
            if name in fit.given and getattr(fit, name) is not None:
                params[f"fit.{name}"] = _text(getattr(fit, name))
        if fit.callbacks:
            params["fit.callbacks"] = _text(",".join(type(c).__name__ for c in fit.callbacks))
        for name in ("validation_data", "sample_weight"):
            if getattr(fit, name) is not None:
                params[f"fit.{name}"] = "given"
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        params["optimizer"] = type(optimizer).__name__
        try:
            opt_config = optimizer.get_config()
        except Exception:  # a custom optimizer without a config: its class name says enough
            opt_config = {}
        for key, value in opt_config.items():
            if value is not None and key != "name":
                params[f"optimizer.{key}"] = _text(value)
    params["model"] = type(model).__name__
    try:
        params["model.parameters"] = str(int(model.count_params()))
    except Exception:  # not built yet: the workers build it
        pass
    return params


def metric_step(state: Any) -> int:
    """The epoch (0-based, as Keras and autologging count) of the merged logs just recorded."""
    return int(state.initial_epoch + state.epochs_done - 1)


# -- the listener ------------------------------------------------------------------------
class RunTracker:
    """Logs one nbdist run into one MLflow run. Start it from the thread whose active run (if any)
    is the parent: the notebook's main thread, where ``job.start()`` runs."""

    def __init__(self, params: dict[str, str], *, run_name: str | None = None, active: str = "nest",
                 parent_run_id: str | None = None, tags: dict[str, str] | None = None,
                 log_model: bool = True) -> None:
        self.params = dict(params)
        self.run_name = run_name
        self.active = active  # "nest": a child of the notebook's active run; "use": log into it
        self.parent_run_id = parent_run_id
        self.tags = dict(tags or {})
        self.log_model = log_model
        self.run_id: str | None = None
        self.off = False  # set by the first failure: one warning, then nothing more for this run
        self._owns_run = True
        self._client: Any = None
        self._job: Any = None

    def attach(self, job: Any) -> None:
        self._job = job

    def __call__(self, kind: str, state: Any, payload: Any) -> None:
        if self.off:
            return
        try:
            if kind == "start":
                self._begin(state)
            elif kind == "epoch" and self.run_id is not None:
                self._epoch(state, payload)
            elif kind == "membership" and self.run_id is not None:
                self._membership(state, payload)
            elif kind == "end" and self.run_id is not None:
                self._end(state)
        except Exception as exc:  # never the training's problem
            self._give_up(f"logging to MLflow failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")

    def _give_up(self, why: str) -> None:
        self.off = True
        log.warning("%s; this run trains on without MLflow tracking.", why)

    def _begin(self, state: Any) -> None:
        mlflow = import_mlflow(required=True)
        uri = mlflow.get_tracking_uri()
        problem = unreachable(uri)
        if problem is not None:
            self._give_up(f"the MLflow tracking server at {uri} is unreachable: {problem}")
            return
        self._client = mlflow.MlflowClient()
        active = mlflow.active_run()
        if self.active == "use" and active is not None and self.parent_run_id is None:
            self.run_id, self._owns_run = active.info.run_id, False
        else:
            parent = self.parent_run_id or (active.info.run_id if active is not None else None)
            tags = {"nbdist.backend": state.backend, **self.tags}
            if parent is not None:
                tags["mlflow.parentRunId"] = parent
                experiment = self._client.get_run(parent).info.experiment_id
            else:
                from mlflow.tracking.fluent import _get_experiment_id

                experiment = _get_experiment_id()  # mlflow.set_experiment's, else the default
            run = self._client.create_run(experiment, tags=tags, run_name=self.run_name)
            self.run_id = run.info.run_id
        from mlflow.entities import Param

        workers = str(state.world_size) if state.min_workers is None else f"{state.min_workers}:{state.world_size}"
        params = {**self.params, "workers": workers, "backend": state.backend, "strategy": state.strategy}
        self._client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])

    def _epoch(self, state: Any, merged: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), metric_step(state)
        metrics = [Metric(key, float(value), now, step) for key, value in merged.items()]
        metrics.append(Metric("epoch_seconds", float(state.epoch_seconds[-1]), now, step))
        self._client.log_batch(self.run_id, metrics=metrics)

    def _membership(self, state: Any, change: Any) -> None:
        """An elastic run's change of workers: the tag ``nbdist.membership.<i>`` is ``job.state.membership[i]``'s
        line (i counts the run's changes from 0, across restarts)."""
        self._client.set_tag(self.run_id, f"nbdist.membership.{len(state.membership) - 1}", _text(change.line))

    def _end(self, state: Any) -> None:
        client, run_id = self._client, self.run_id
        if state.error:
            client.set_tag(run_id, "nbdist.error", _text(state.error))
        with tempfile.TemporaryDirectory(prefix="nbdist-mlflow-") as tmp:
            self._log_figure(state, tmp)
            if self.log_model and state.status in ("done", "stopped") and self._job is not None:
                self._log_keras_model(self._job.model, tmp)
        if self._owns_run:
            client.set_terminated(run_id, RUN_STATUS.get(state.status, "FINISHED"))

    def _log_figure(self, state: Any, tmp: str) -> None:
        from .summary import chart_png

        png = chart_png(state)  # the dashboard's end-of-run chart; None without matplotlib or metrics
        if png is None:
            return
        path = os.path.join(tmp, "nbdist_summary.png")
        with open(path, "wb") as f:
            f.write(png)
        self._client.log_artifact(self.run_id, path)

    def _log_keras_model(self, model: Any, tmp: str) -> None:
        """The trained model as an MLflow Keras model under ``model/`` (``mlflow.keras.load_model(
        "runs:/<id>/model")``), saved here and uploaded: ``mlflow.keras.log_model`` would need the
        fluent active run, which a background run's thread does not have."""
        import keras
        import mlflow.keras

        path = os.path.join(tmp, "model")
        try:
            mlflow.keras.save_model(model, path, pip_requirements=model_requirements(keras.config.backend()))
        except Exception as exc:  # e.g. a notebook class Keras cannot save: the rest is logged
            log.warning("the trained model could not be saved for MLflow (%s: %s); params, metrics and "
                        "the chart are logged.", type(exc).__name__, str(exc).splitlines()[0][:200])
            return
        self._client.log_artifacts(self.run_id, path, "model")


class SearchRun:
    """The parent MLflow run of a hyperparameter search (``nbdist.tune``); its trials are child runs
    (``RunTracker`` with ``parent_run_id``). Failures cost one warning, as for a run."""

    def __init__(self, name: str, params: dict[str, str], active: str = "nest") -> None:
        self.run_id: str | None = None
        self._client: Any = None
        self._owns_run = True
        try:
            mlflow = import_mlflow(required=True)
            uri = mlflow.get_tracking_uri()
            problem = unreachable(uri)
            if problem is not None:
                log.warning("the MLflow tracking server at %s is unreachable: %s; the search runs without MLflow "
                            "tracking.", uri, problem)
                return
            self._client = mlflow.MlflowClient()
            current = mlflow.active_run()
            if active == "use" and current is not None:
                self.run_id, self._owns_run = current.info.run_id, False
            else:
                tags = {"mlflow.parentRunId": current.info.run_id} if current is not None else {}
                if current is not None:
                    experiment = current.info.experiment_id
                else:
                    from mlflow.tracking.fluent import _get_experiment_id

                    experiment = _get_experiment_id()
                self.run_id = self._client.create_run(experiment, tags=tags, run_name=name).info.run_id
            from mlflow.entities import Param

            self._client.log_batch(self.run_id, params=[Param(k, _text(v)) for k, v in params.items()])
        except NbdistError:
            raise
        except Exception as exc:
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        self.run_id = None
        log.warning("logging the search to MLflow failed (%s: %s); it runs on without MLflow tracking.",
                    type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")

    def end(self, status: str, best_value: float | None, best_params: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        try:
            from mlflow.entities import Metric, Param

            metrics = [] if best_value is None else [Metric("best_value", float(best_value), int(time.time() * 1000),
                                                            0)]
            params = [Param(f"best.{k}", _text(v)) for k, v in best_params.items()]
            self._client.log_batch(self.run_id, metrics=metrics, params=params)
            if self._owns_run:
                self._client.set_terminated(self.run_id, {"done": "FINISHED", "failed": "FAILED"}.get(status, "KILLED"))
        except Exception as exc:
            self._fail(exc)


def tracker_for(config: TrainConfig, model: Any, fit: FitCall | None = None,
                **options: Any) -> RunTracker | None:
    """The tracker of a run, or None when this run is not tracked (see ``wanted``)."""
    if not wanted(config.mlflow):
        return None
    autolog = keras_autolog_config() or {}
    return RunTracker(run_params(config, model, fit), run_name=config.run_name, active=config.mlflow_active,
                      log_model=bool(autolog.get("log_models", True)), **options)


def track(job: Any, config: TrainConfig, fit: FitCall | None = None) -> None:
    """Log ``job`` to MLflow when the notebook tracks (a listener after the dashboard)."""
    tracker = tracker_for(config, job.model, fit)
    if tracker is not None:
        tracker.attach(job)
        job.listeners.append(tracker)


__all__ = ["RunTracker", "SearchRun", "import_mlflow", "keras_autolog_config", "run_params", "track", "tracker_for",
           "unreachable", "wanted"]
