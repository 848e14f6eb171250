"""Per-epoch agreement between workers: exact merged metrics, and the driver's callback decisions.

Metrics: Keras computes an epoch's logs from the metric variables (totals and counts, AUC's thresholded
TP/FP/TN/FN, ...). Summing those variables over the workers before Keras reads them gives every worker the
logs one process would compute over all the data (an average of per-worker AUCs would not). Done after the
last training batch (Keras reads ``epoch_logs`` then, before validation resets the metrics) and after the
last validation batch. Decisions: the notebook's callbacks run on the driver with those merged logs
(driver/callbacks.py); at every epoch end each worker waits for the driver's word (stop now; the next
epoch's learning rate), so all workers act on it at the same epoch.
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Any

import keras
import numpy as np

from ..fit_arguments import validates
from ..machine.keras_backend import OPTIONAL_AT_IMPORT
from ..model.spec import keras_own
from ..strategies.backend_grads import synced_state
from ..wire.commands import Decision
from ..wire.messages import JobMessage
from .callback_list import WorkerCallbacks
from .callbacks import notebook_callbacks
from .validation import KeepValidationIterator, reads_whole_passes

log = logging.getLogger("nbdist.worker")


class MetricStateSum:
    """Sums a model's metric variables over the workers, in float64 (counts stay exact).

    Through one shared-memory segment when every worker runs on this machine (``strategies/shared.py``; opened
    at the first sum, the same point on every worker), else by the collective's allreduce after a
    size check. Measured on the quickstart MLP: the two Gloo allreduces of a sum took 2-6 ms, twice
    an epoch; the shared sum a few tens of microseconds plus the wait for the slowest worker.
    """

    def __init__(self, collective: Any, model: Any, shared_memory: bool = True) -> None:
        self.collective = collective
        self.model = model
        self.shared_memory = shared_memory
        self.seconds = 0.0
        self._summer: Any = None
        self._opened = False

    def variables(self) -> list[Any]:
        seen, out = set(), []
        for metric in self.model.metrics:
            for v in metric.variables:
                if id(v) not in seen:
                    seen.add(id(v))
                    out.append(v)
        return out

    def sum(self, contribute: bool = True) -> None:
        """``contribute=False``: a worker with no rows to add (no validation shard) joins with zeros
        and keeps its own metrics."""
        if self.collective.world_size == 1:
            return
        t0 = time.perf_counter()
        synced_state(self.model)  # JAX: the metric variables hold the running fit's or evaluate's values
        variables = self.variables()
        values = [np.asarray(v.numpy()) for v in variables]
        flat = np.concatenate([a.astype(np.float64).reshape(-1) for a in values]) if values else np.zeros(0)
        if not contribute:
            flat[:] = 0.0
        self._sum(flat)
        if not contribute:
            self.seconds += time.perf_counter() - t0
            return
        offset = 0
        for v, a in zip(variables, values):
            part = flat[offset:offset + a.size].reshape(a.shape)
            offset += a.size
            v.assign(np.round(part).astype(a.dtype) if a.dtype.kind in "iu" else part.astype(a.dtype))
        self.seconds += time.perf_counter() - t0

    def total(self) -> np.ndarray:
        """The metric state summed over the workers (float64, flat), the variables left as they are: an elastic
        run's mid-epoch commit (worker/elastic.py)."""
        synced_state(self.model)
        values = [np.asarray(v.numpy()) for v in self.variables()]
        flat = np.concatenate([a.astype(np.float64).reshape(-1) for a in values]) if values else np.zeros(0)
        if self.collective.world_size > 1:
            self._sum(flat)
        return flat

    def _sum(self, flat: np.ndarray) -> None:
        if not self._opened:  # the first sum, at the same point on every worker
            self._opened = True
            self._check_size(flat.size)  # a model's metric variables do not change during its fit
            self._summer = self._open(flat.size)
        elif self._summer is None:
            self._check_size(flat.size)
        if self._summer is not None:
            clock = getattr(self.collective, "clock", None)
            if clock is not None:
                clock.enter()
            try:
                self._summer(flat)
            finally:
                if clock is not None:
                    clock.leave()
            return
        if flat.size:
            self.collective.allreduce_sum(flat)

    def _check_size(self, length: int) -> None:
        """Workers whose metrics differ must fail, not mix unrelated numbers."""
        size = np.array([length], dtype=np.float64)
        self.collective.allreduce_sum(size)
        if int(size[0]) != length * self.collective.world_size:
            raise RuntimeError("workers hold different metric variables; every worker must run the same model")

    def _open(self, length: int) -> Any:
        from ..strategies.collective import GlooCollective
        from ..strategies.shared import open_shared_sum

        inner = getattr(self.collective, "inner", self.collective)  # PhaseCollective wraps the engine
        if not self.shared_memory or not length or not isinstance(inner, GlooCollective):
            return None
        return open_shared_sum(inner, length, np.float64)

    def close(self) -> None:
        close = getattr(self._summer, "close", None)
        if close is not None:
            close()


class MetricSumCallback(keras.callbacks.Callback):
    """Runs ``MetricStateSum`` after this worker's last training batch and last validation batch."""

    # Its batch ends run in order on the training thread, called by the worker's list (callback_list.py).
    batch_end_in_order = True

    def __init__(self, summer: MetricStateSum, train_steps: int, val_steps: int | None,
                 others_validate: bool = False, validation_freq: int = 1) -> None:
        super().__init__()
        self.summer = summer
        self.train_steps = train_steps
        self.val_steps = val_steps
        # No validation rows here but other workers validate: join their sum with zeros.
        self.join_with_zeros = others_validate and val_steps is None
        self.validation_freq = validation_freq

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.join_with_zeros and validates(epoch, self.validation_freq):
            self.summer.sum(contribute=False)

    def on_train_end(self, logs: Any = None) -> None:
        self.summer.close()

    # ``>=``: a call of several steps (blocks.py) reports its last batch, possibly past the pass's end.
    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if batch >= self.train_steps - 1:
            self.summer.sum()

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.val_steps is not None and batch >= self.val_steps - 1:
            self.summer.sum()


class DecisionCallback(keras.callbacks.Callback):
    """Waits at every epoch end for the driver's decision and applies it (stop, learning rate)."""

    def __init__(self, link: Any, timeout: float, lr_factor: float = 1.0) -> None:
        super().__init__()
        self.link = link
        self.timeout = timeout
        self.lr_factor = lr_factor
        self.learning_rates: list[float] = []  # the rate each epoch trained with, for the closing report
        self.last_epoch: int | None = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.learning_rates.append(current_learning_rate(self.model))

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.last_epoch = epoch
        while True:
            decision = self.link.expect(Decision, timeout=self.timeout)
            if decision.epoch == epoch:
                break
            log.warning("ignoring the driver's decision for epoch %s at epoch %d", decision.epoch, epoch)
        apply_decision(self.model, decision, self.lr_factor)


def apply_decision(model: Any, decision: Decision, lr_factor: float = 1.0) -> None:
    if decision.stop:
        model.stop_training = True
    lr = decision.learning_rate
    if lr is not None and hasattr(model.optimizer.learning_rate, "assign"):
        model.optimizer.learning_rate.assign(float(lr) * lr_factor)


def current_learning_rate(model: Any) -> float:
    try:
        return float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))
    except Exception:  # a schedule object: no single rate
        return float("nan")


def sync_callbacks(link: Any, job: JobMessage, model: Any, collective: Any, inputs: dict[str, Any],
                   lr_factor: float) -> tuple[list[Any], DecisionCallback | None]:
    """The callbacks that go after the strategy's and the event stream's: metric sums, decisions."""
    out: list[Any] = []
    if collective.world_size > 1:  # a batch hook costs every step its async dispatch
        out.append(MetricSumCallback(MetricStateSum(collective, model, bool(job.train.shared_memory)),
                                     int(inputs["steps_per_epoch"]),
                                     inputs.get("validation_steps"), job.train.validation_anywhere,
                                     int(job.train.validation_freq)))
    decision = None
    if job.train.epoch_decisions:
        decision = DecisionCallback(link, float(job.train.sync_timeout), lr_factor)
        out.append(decision)
    return out, decision


def closing_report(decision: DecisionCallback | None) -> dict[str, Any]:
    if decision is None:
        return {}
    return {"last_epoch": decision.last_epoch, "learning_rates": decision.learning_rates}


def fit_and_report(link: Any, job: JobMessage, model: Any, collective: Any, inputs: dict[str, Any],
                   lr_factor: float, callbacks: list[Any], phases: Any, feed: Any = None,
                   shipper: Any = None) -> dict[str, Any]:
    """Keras' fit with the strategy's ``callbacks``, the phase timers around them and the metric sums and
    decisions after them; returns what both strategies add to their closing report.

    ``feed``: a PyDataset's reader, closed when fit ends. ``shipper``: rank 0's weight shipper, which
    sends the last epoch's weights if they have not gone yet."""
    if phases is not None:
        first, last = phases.callbacks()
        callbacks = [first, *callbacks, last]
    if keras.backend.backend() == "torch":
        from ..strategies.backend_grads import SelfDistributionGuard

        callbacks = [SelfDistributionGuard(), *callbacks]
    # After the strategy's rounds or padding steps: metric sums pair up in the same order on every worker.
    extra, decision = sync_callbacks(link, job, model, collective, inputs, lr_factor)
    if reads_whole_passes(inputs.get("validation_data")):
        extra.append(KeepValidationIterator())
    extra += notebook_callbacks(bool(job.train.swap_ema), bool(job.train.raise_on_nan),
                                job.train.batch_summaries if job.rank == 0 else None)
    listed = WorkerCallbacks(callbacks + extra, model, int(job.train.epochs), inputs.get("steps_per_epoch"))
    try:
        keras_own(model, "fit")(**inputs, epochs=int(job.train.epochs), verbose=0, callbacks=listed,
                                initial_epoch=int(job.train.initial_epoch),
                                validation_freq=int(job.train.validation_freq))
    finally:
        if feed is not None:
            feed.close()
    report = closing_report(decision)
    report["keras_backend"] = keras.backend.backend()
    report["tensorflow_loaded"] = "tensorflow" in sys.modules  # never on JAX or torch (machine/keras_backend.py)
    # Installed packages Keras and TensorFlow would have loaded for nothing (keras_backend.OPTIONAL_AT_IMPORT).
    report["optional_imports"] = sorted(m for m in OPTIONAL_AT_IMPORT if m in sys.modules)
    if phases is not None:
        report["phase_times"] = phases.epochs
    if shipper is not None:
        shipper.finish()
        report["weights_sent"] = shipper.sent
    return report


def set_initial_learning_rate(model: Any, job: JobMessage) -> None:
    """The rate the driver's callbacks chose for the first epoch (e.g. LearningRateScheduler)."""
    lr = job.train.learning_rate
    if lr is not None and hasattr(model.optimizer.learning_rate, "assign"):
        model.optimizer.learning_rate.assign(float(lr))
