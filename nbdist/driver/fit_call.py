"""A ``model.fit(...)`` call as nbdist runs it: its arguments, its data dealt to workers, its callbacks.

Under ``%%dist_train`` the cell's own ``model.fit(...)`` is intercepted (``intercept_fit``): the call runs
on the workers with its arguments and returns a ``keras.callbacks.History`` of the merged per-epoch
metrics; ``nbdist.train`` takes the same arguments. Its ``batch_size`` is the GLOBAL batch, split over the
workers (sizes differ by at most one), so every step of all workers together sees the rows one local step
would and the same cell trains the same way with or without the magic (``--strategy allreduce``, or
averaging every step with plain SGD, equal the local call). ``--batch-size`` on the magic line stays per
worker.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..data.files import pipeline_message
from ..data.inputs import (
    FitData,
    PyDatasetData,
    class_weight_to_sample_weight,
    is_py_dataset,
    make_fit_data,
    make_py_dataset_data,
    split_validation,
)
from ..data.sharding import deal_rows, rank_batch_sizes
from ..data.structures import to_struct
from ..errors import NbdistError
from ..fit_arguments import FitCall, check_count
from .callbacks import DriverCallbacks

log = logging.getLogger(__name__)

KERAS_DEFAULT_BATCH = 32  # what Keras' fit uses when batch_size is not given


@dataclass
class FitRun:
    """What a TrainingJob needs beyond a plain run: the batch plan and the notebook's callbacks."""

    callbacks: DriverCallbacks
    initial_epoch: int = 0
    global_batch: int | None = None  # None: --batch-size per worker times the workers
    rows: int = 0
    validation_freq: int = 1  # fit's: validate after every that many epochs, as Keras does
    epochs: int = 1
    steps_per_epoch: int | None = None  # fit's: an epoch of that many batches (the data not rewound)
    validation_steps: int | None = None  # fit's: each validation reads the first that many batches
    validation_batch: int | None = None  # fit's validation_batch_size (None: the global batch)

    def batch(self, world: int, per_worker_batch: int) -> int:
        return self.global_batch if self.global_batch is not None else per_worker_batch * world

    def plan(self, world: int, per_worker_batch: int) -> tuple[list[int], list[np.ndarray]]:
        """Each worker's batch size and row indices (every global batch split over the workers)."""
        batch = self.batch(world, per_worker_batch)
        return rank_batch_sizes(batch, world), deal_rows(self.rows, batch, world)

    def worker_steps(self, world: int, per_worker_batch: int) -> int | None:
        """The steps every worker runs per epoch under ``steps_per_epoch`` (None: an epoch is one pass)."""
        return uniform_epoch_steps(self.rows, self.batch(world, per_worker_batch), self.steps_per_epoch,
                                   self.epochs - self.initial_epoch)

    def py_dataset_steps(self, batches: int) -> int | None:
        """A PyDataset's batches read per epoch under ``steps_per_epoch`` (None: an epoch is one pass)."""
        return uniform_epoch_steps(batches, 1, self.steps_per_epoch, self.epochs - self.initial_epoch,
                                   f"the PyDataset's {batches} batches")

    def validation_rows(self, rows: int, world: int, per_worker_batch: int | None) -> int:
        """The validation rows Keras reads under ``validation_steps``: its first batches, every time, of
        ``validation_batch_size`` rows, else the fit's batch (None: a PyDataset's fit, whose Keras default is 32)."""
        if self.validation_steps is None:
            return rows
        batch = KERAS_DEFAULT_BATCH if per_worker_batch is None else self.batch(world, per_worker_batch)
        return min(rows, self.validation_steps * (self.validation_batch or batch))

    def data_start(self, start_epoch: int, first_epoch: int, steps: int | None, batches: int) -> tuple[int, int]:
        """(pass, batch) where epoch ``start_epoch`` starts reading, for a fit whose data started at
        ``first_epoch``: the pipeline counts its passes from the epoch it starts at (worker/datasets.py)."""
        if steps is None:
            return start_epoch, 0
        done, batch = divmod((start_epoch - first_epoch) * steps, batches)
        return first_epoch + done, batch


def keras_epoch_steps(batches: int, steps_per_epoch: int | None, epochs: int) -> list[int]:
    """Steps of each of ``epochs`` epochs of Keras' ``fit`` on in-memory arrays of ``batches`` batches.

    Keras 3 keeps one iterator over the data across epochs: an epoch reads ``steps_per_epoch`` batches
    where the last one stopped, is cut short where the data ends (with a warning), and the data starts
    over at the next epoch (Keras' trainers/epoch_iterator.py)."""
    if not steps_per_epoch:
        return [batches] * epochs
    out, position = [], 0
    for _ in range(epochs):
        steps = min(steps_per_epoch, batches - position)
        out.append(steps)
        position = 0 if position + steps >= batches else position + steps
    return out


def uniform_epoch_steps(rows: int, batch: int, steps_per_epoch: int | None, epochs: int,
                        batches_are: str | None = None) -> int | None:
    """``steps_per_epoch`` as the workers run it: None for whole passes, else every epoch's step count.

    nbdist runs every epoch with the same steps and batch sizes on every worker, so Keras' epochs must
    all be alike: one sentence otherwise (``batches_are``: how it names the data's batches)."""
    batches = -(-rows // batch)
    steps = keras_epoch_steps(batches, steps_per_epoch, epochs)
    if all(s == batches for s in steps):
        return None  # every epoch one pass: as without steps_per_epoch
    if len(set(steps)) > 1:
        shown = ", ".join(map(str, steps[:6])) + (", ..." if len(steps) > 6 else "")
        named = batches_are or f"the {batches} batches of batch_size {batch} in the data"
        raise NbdistError(f"steps_per_epoch={steps_per_epoch} does not divide {named}, so Keras would cut some of "
                          f"these epochs short where the data ends (steps per epoch: {shown}), which nbdist cannot "
                          f"keep in step over the workers; use a steps_per_epoch that divides {batches}, or run at "
                          f"most {batches // steps_per_epoch} epoch(s) in this call.")
    short = rows % batch
    if short and sum(steps) >= batches:
        raise NbdistError(f"with steps_per_epoch={steps_per_epoch} some epoch ends with the short last batch "
                          f"({short} of {rows} rows, batch_size {batch}) and the others do not, which nbdist cannot "
                          f"keep in step over the workers; pass a number of rows that is a multiple of {batch} "
                          f"(x[:{rows - short}]), or fewer epochs.")
    return steps[0]


# -- fit's arguments -----------------------------------------------------------
def bind_fit(model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], sig: inspect.Signature) -> FitCall:
    """A cell's ``model.fit(*args, **kwargs)`` bound to Keras' own fit signature ``sig``: defaults filled in,
    ``given`` naming those spelled out."""
    try:
        bound = sig.bind(model, *args, **kwargs)
    except TypeError as exc:
        raise NbdistError(f"model.fit(...) {exc}; call it as you would without the magic.") from None
    given = frozenset(bound.arguments) - {"self"}
    bound.apply_defaults()
    return FitCall(**{k: v for k, v in bound.arguments.items() if k in FitCall.names()}, given=given)


def check_fit_arguments(fit: FitCall) -> None:
    """One sentence for what cannot be distributed soundly, before any worker starts."""
    for name in ("steps_per_epoch", "validation_steps", "validation_batch_size"):
        check_count(name, getattr(fit, name))
    freq = fit.validation_freq
    if isinstance(freq, bool) or not isinstance(freq, (int, np.integer)) or freq < 1:
        raise NbdistError(f"validation_freq must be a whole number of epochs of at least 1, got {freq!r} (Keras 3 "
                          "takes an integer: validate every that many epochs).")
    if fit.class_weight is not None and fit.sample_weight is not None:
        raise NbdistError("class_weight and sample_weight cannot be used together (as in Keras); fold the class "
                          "weights into sample_weight.")
    for name in ("epochs", "initial_epoch"):
        value = getattr(fit, name)
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise NbdistError(f"{name} must be a whole number, got {value!r}.")
    if fit.initial_epoch >= fit.epochs:
        raise NbdistError(f"initial_epoch={fit.initial_epoch} is not below epochs={fit.epochs}: nothing to "
                          "train; epochs is the index of the last epoch, as in Keras.")
    batch = fit.batch_size
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, (int, np.integer)) or batch < 1):
        raise NbdistError(f"batch_size must be a whole number of at least 1, got {batch!r}.")
    cbs = fit.callbacks
    if cbs is not None and not isinstance(cbs, (list, tuple)):
        raise NbdistError("callbacks must be a list of keras.callbacks.Callback objects, e.g. callbacks=[cb].")
    for cb in cbs or []:
        check_batch_frequency(cb)


def check_batch_frequency(callback: Any) -> None:
    """Keras' callbacks that act every N batches would silently never act: the batches run on the workers."""
    freq = getattr(callback, "save_freq", "epoch")
    if not isinstance(freq, bool) and isinstance(freq, (int, np.integer)):
        name = type(callback).__name__
        raise NbdistError(f"{name}(save_freq={freq}) saves every {freq} batches, but under %%dist_train the "
                          f"batches run on the workers and the notebook's callbacks act at epoch ends; use "
                          f"{name}(save_freq='epoch') (the default).")


def fit_data(fit: FitCall) -> tuple[FitData | PyDatasetData, FitData | PyDatasetData | None]:
    """Training and validation data exactly as Keras' fit would take them from these arguments."""
    x = fit.x
    if x is None:
        raise NbdistError("model.fit(...) was called without x; pass the training data, e.g. model.fit(X, y).")
    if is_py_dataset(x):
        return py_dataset_fit_data(fit)
    data = make_fit_data(x, fit.y, fit.sample_weight, "training data")
    validation = None
    vd = fit.validation_data
    if isinstance(vd, PyDatasetData):  # a generator's validation passes (data/pipelines.py)
        validation = vd
    elif is_py_dataset(vd):
        validation = make_py_dataset_data(vd, "validation_data")
    elif vd is not None:
        if not isinstance(vd, (tuple, list)) or len(vd) not in (2, 3):
            kind = "a tuple" if isinstance(vd, (tuple, list)) else None
            try:
                to_struct(vd, "validation_data")
            except NbdistError as exc:
                if kind is None:
                    raise exc from None
            raise NbdistError("validation_data must be (x_val, y_val) or (x_val, y_val, val_sample_weight) "
                              "with in-memory arrays.")
        validation = make_fit_data(vd[0], vd[1], vd[2] if len(vd) == 3 else None, "validation data")
    elif fit.validation_split:
        data, validation = split_validation(data, fit.validation_split)
    cw = fit.class_weight
    if cw is not None:  # Keras weights the training rows only
        data = FitData(data.x, data.y, class_weight_to_sample_weight(data.y, cw))
    return data, validation


def py_dataset_fit_data(fit: FitCall) -> tuple[PyDatasetData, FitData | PyDatasetData | None]:
    """A PyDataset's fit: Keras' own rules (no y, sample_weight or validation_split beside it)."""
    for name, why in (("y", "the PyDataset's batches hold the labels"),
                      ("sample_weight", "return (x, y, sample_weight) from its __getitem__ instead"),
                      ("validation_split", "pass validation_data (arrays or another PyDataset) instead")):
        value = getattr(fit, name)
        if value is not None and not (isinstance(value, (int, float)) and value == 0):  # 0.0: the default split
            raise NbdistError(f"model.fit(...) was given a PyDataset and {name}; drop {name} ({why}), "
                              "as Keras requires.")
    data = make_py_dataset_data(fit.x, "training data", fit.class_weight)
    vd = fit.validation_data
    validation: FitData | PyDatasetData | None = None
    if isinstance(vd, PyDatasetData):  # a generator's validation passes (data/pipelines.py)
        validation = vd
    elif is_py_dataset(vd):
        validation = make_py_dataset_data(vd, "validation_data")
    elif vd is not None:
        if not isinstance(vd, (tuple, list)) or len(vd) not in (2, 3):
            raise NbdistError("validation_data must be (x_val, y_val), (x_val, y_val, val_sample_weight) or a "
                              "keras.utils.PyDataset.")
        validation = make_fit_data(vd[0], vd[1], vd[2] if len(vd) == 3 else None, "validation data")
    return data, validation


def fit_plan(fit: FitCall, explicit: dict[str, Any], lr_scaling_given: bool) -> tuple[dict[str, Any], int | None]:
    """For a cell's ``model.fit(...)`` (an input pipeline already read into arrays, data/pipelines.py) under the
    magic's ``explicit`` options: the config changes they make, and the global batch."""
    agreed = reconcile(fit, explicit)
    changes = {"epochs": agreed["epochs"], "shuffle": agreed["shuffle"]}
    if agreed["global_batch"] is not None and not lr_scaling_given:
        changes["lr_scaling"] = "none"  # the global batch is the local one: no rescaling
    if "batch_size" in agreed:
        changes["batch_size"] = agreed["batch_size"]
    return changes, agreed["global_batch"]


def reconcile(fit: FitCall, magic: dict[str, Any]) -> dict[str, Any]:
    """TrainConfig options for this fit call: the magic line's and the call's must agree.

    ``magic`` holds only the options typed on the magic line. Returns the options to use,
    including ``global_batch`` (None: ``batch_size`` per worker times the workers).
    """
    given = fit.given
    out: dict[str, Any] = {}
    if magic.get("data") is not None:
        raise NbdistError("the cell calls model.fit(...) with its own data and the magic line has --data; "
                          "drop --data (or the cell's fit call, to train on --data).")
    if magic.get("validation_data") is not None and ("validation_data" in given or "validation_split" in given):
        raise NbdistError("--validation-data on the magic line and validation data in model.fit(...) both set "
                          "the validation data; keep one.")
    if "epochs" in magic and "epochs" in given and magic["epochs"] != fit.epochs:
        raise NbdistError(f"--epochs {magic['epochs']} on the magic line but model.fit(epochs={fit.epochs}) in "
                          "the cell; keep one (they must agree).")
    out["epochs"] = int(magic["epochs"] if "epochs" in magic and "epochs" not in given else fit.epochs)
    if is_py_dataset(fit.x):  # its own batches; one step of all workers reads `workers` of them
        if fit.batch_size is not None or "batch_size" in magic:
            raise NbdistError("a PyDataset makes its own batches: drop batch_size from model.fit(...) and "
                              "--batch-size from the magic line (each worker reads whole batches of it).")
        out["global_batch"] = None
        out["py_dataset"] = True
        out["shuffle"] = bool(fit.shuffle)
        return out
    if "batch_size" in magic and fit.batch_size is not None:
        raise NbdistError(f"--batch-size {magic['batch_size']} (per worker) on the magic line and "
                          f"model.fit(batch_size={fit.batch_size}) (the global batch, split over the workers) "
                          "both set the batch; keep one.")
    if "batch_size" in magic:
        out["batch_size"], out["global_batch"] = int(magic["batch_size"]), None
    else:
        out["global_batch"] = int(fit.batch_size or KERAS_DEFAULT_BATCH)
    out["shuffle"] = bool(fit.shuffle)
    return out


def prepare_fit_run(model: Any, fit: FitCall, epochs: int, global_batch: int | None, rows: int) -> FitRun:
    callbacks = DriverCallbacks(model, list(fit.callbacks or []), epochs, int(fit.initial_epoch or 0))
    return FitRun(callbacks, int(fit.initial_epoch or 0), global_batch, rows, int(fit.validation_freq or 1),
                  int(epochs), fit.steps_per_epoch, fit.validation_steps, fit.validation_batch_size)


# -- interception ----------------------------------------------------------------
class FitAborted(BaseException):
    """Raised out of an intercepted fit so the cell stops; the magic reports ``cause`` in one sentence.

    A BaseException (as KeyboardInterrupt is): the cell's own ``except Exception:`` around its fit (as
    keras-tuner's search has) must not swallow nbdist's refusal and go on."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause

    def _render_traceback_(self) -> list[str]:  # IPython: no traceback, the magic reports the cause
        return []


@dataclass
class FitOutcome:
    """What the intercepted calls ended with: ``aborted`` the causes nbdist stopped the cell for (NbdistError,
    TrainingFailed, KeyboardInterrupt: the call raised FitAborted), ``raised`` what Keras or the cell's code
    raised (on a worker, or in a notebook callback), which the call raised as it is, as Keras' fit would."""

    aborted: list[BaseException]
    raised: list[BaseException]


@contextlib.contextmanager
def intercept_fit(run: Callable[[Any, FitCall], Any]) -> Iterator[FitOutcome]:
    """While the cell runs, ``keras.Model.fit`` calls ``run(model, fit_arguments)`` instead."""
    import keras

    original = keras.Model.fit
    signature = inspect.signature(original)
    outcome = FitOutcome([], [])

    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return run(self, bind_fit(self, args, kwargs, signature))
        except (NbdistError, KeyboardInterrupt) as exc:
            outcome.aborted.append(exc)
            raise FitAborted(exc) from None
        except Exception as exc:
            outcome.raised.append(exc)
            raise

    fit.__doc__ = original.__doc__
    keras.Model.fit = fit
    try:
        yield outcome
    finally:
        keras.Model.fit = original


__all__ = ["FitRun", "FitAborted", "FitOutcome", "bind_fit", "check_fit_arguments", "fit_data", "intercept_fit",
           "reconcile", "prepare_fit_run", "pipeline_message"]
