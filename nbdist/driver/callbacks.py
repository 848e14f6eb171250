"""The notebook's Keras callbacks, run on the driver with the workers' merged logs.

Each callback sees what it would see in a local ``fit``: ``self.model`` is the notebook's model holding the
weights every worker shares at the epoch's end, ``logs`` are the exact merged metrics, and the epoch-level
hooks run in Keras' order with History last (``DriverCallbacks``). What they decide (``model.stop_training``,
the next epoch's learning rate) reaches every worker before its next epoch. Files (ModelCheckpoint, CSVLogger,
TensorBoard's epoch part) are written once, here. SwapEMAWeights and TerminateOnNaN(raise_error=True) act
inside the passes, so the workers run them too (``swaps_ema``, ``raises_on_nan``); worker 0 writes
TensorBoard's batch part (``batch_summaries``). Other batch-level hooks are NOT called (a round trip per step
would cost most of the speed-up): a callback that has one gets a warning naming it.
"""
from __future__ import annotations

import logging
from typing import Any

from ..model.spec import uses_ema
from ..wire.commands import Decision
from ..wire.messages import BatchSummaries

log = logging.getLogger(__name__)

_BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_test_batch_begin", "on_test_batch_end",
                "on_batch_begin", "on_batch_end")


def overrides_batch_hooks(callback: Any) -> list[str]:
    """The batch hooks ``callback`` has: overridden on its class, or set on the instance (LambdaCallback)."""
    import keras

    base = keras.callbacks.Callback
    own = getattr(callback, "__dict__", {})
    return [h for h in _BATCH_HOOKS if h in own or getattr(type(callback), h, None) is not getattr(base, h, None)]


def warned_batch_hooks(callback: Any) -> list[str]:
    """The batch hooks worth a warning: all of a notebook's callback's, and those set on an instance of one of
    Keras' own (LambdaCallback's); Keras' own classes' overrides act only when asked to (TensorBoard's
    update_freq="batch") or are done otherwise here (TerminateOnNaN)."""
    hooks = overrides_batch_hooks(callback)
    if type(callback).__module__.startswith("keras"):
        hooks = [h for h in hooks if h in getattr(callback, "__dict__", {})]
    return hooks


class DriverCallbacks:
    """A ``keras.callbacks.CallbackList`` (with a History) driven by the run's merged epochs.

    Keras' order: ``on_train_begin``; per epoch ``on_epoch_begin``, then, where the epoch validated,
    ``on_test_begin`` and ``on_test_end`` with the validation logs under their own names (``loss``, not
    ``val_loss``: Keras' evaluate's), then ``on_epoch_end`` with every log; ``on_train_end`` with the last
    epoch's logs. History is last, so it records what the others wrote into the logs (ReduceLROnPlateau's
    ``learning_rate``). The learning rate sent on is read after the next epoch's ``on_epoch_begin``
    (LearningRateScheduler). EarlyStopping's restored weights are the notebook model's when training ends; an
    exception a callback raises ends the run and is raised out of the fit as it is. A plain TerminateOnNaN stops
    after the epoch whose merged loss is not finite."""

    def __init__(self, model: Any, callbacks: list[Any] | None, epochs: int, initial_epoch: int = 0) -> None:
        import keras

        self.model = model
        self.user = list(callbacks or [])
        self.epochs = epochs
        self.initial_epoch = initial_epoch
        for cb in self.user:
            hooks = warned_batch_hooks(cb)
            if hooks:
                log.warning("%s defines %s; under nbdist only epoch-level hooks run (on the notebook, with "
                            "merged logs), batch-level hooks are not called.", type(cb).__name__, ", ".join(hooks))
        self.history = keras.callbacks.History()
        self.list = keras.callbacks.CallbackList(self.user + [self.history], add_history=False,
                                                 add_progbar=False, model=model, verbose=0, epochs=epochs)
        self.ended = False
        self._last_logs: dict[str, Any] | None = None  # the last epoch's logs as on_epoch_end got them: on_train_end's

    @property
    def needs_model(self) -> bool:
        """Whether a callback may read (or save) ``self.model`` at an epoch's end: then the workers
        send the weights every epoch. Only Keras' own callbacks known to read nothing but the logs
        and the learning rate are spared; a subclass or a notebook's callback may do anything."""
        return any(not reads_logs_only(cb) for cb in self.user)

    @property
    def needs_decisions(self) -> bool:
        """Whether workers wait at each epoch end for the notebook (only when a callback can decide)."""
        return bool(self.user)

    @property
    def terminates_on_nan(self) -> bool:
        """A ``keras.callbacks.TerminateOnNaN`` is among them: a non-finite loss stops training after the
        epoch (as in Keras, the History keeps it)."""
        import keras

        return any(isinstance(cb, keras.callbacks.TerminateOnNaN) for cb in self.user)

    @property
    def raises_on_nan(self) -> bool:
        """A ``TerminateOnNaN(raise_error=True)``: the workers run one, raising Keras' RuntimeError at the batch."""
        import keras

        return any(isinstance(cb, keras.callbacks.TerminateOnNaN) and cb.raise_error for cb in self.user)

    @property
    def swaps_ema(self) -> bool:
        """A ``keras.callbacks.SwapEMAWeights``: the workers validate with the moving averages swapped in."""
        import keras

        return any(isinstance(cb, keras.callbacks.SwapEMAWeights) for cb in self.user)

    def batch_summaries(self, same_files: bool) -> BatchSummaries | None:
        """What the notebook's ``keras.callbacks.TensorBoard`` writes inside the passes, for worker 0 to write
        (``same_files``: the workers see the notebook's filesystem); None unless it acts at every batch
        (``update_freq`` a number, ``profile_batch``): the train graph alone is not worth a second writer. Where the
        workers write elsewhere (Spark executors, containers), the batch-level part is said in one line."""
        import keras

        boards = [cb for cb in self.user if isinstance(cb, keras.callbacks.TensorBoard)]
        if not boards:
            return None
        board = boards[0]
        freq = 0 if board.update_freq == "epoch" else int(board.update_freq)
        trace = [int(board._start_batch), int(board._stop_batch)] if board._should_trace else [0, 0]
        part = BatchSummaries(str(board.log_dir), freq, trace, bool(board.write_steps_per_second),
                              bool(board.write_graph))
        if not part.per_batch:  # the epoch's part alone: one event file per run directory, as locally
            return None
        if same_files:
            return part
        log.warning("TensorBoard(update_freq=%r, profile_batch=%r) writes batch-level summaries, but these "
                    "workers do not share the notebook's files: only the epoch's summaries are written "
                    "(update_freq='epoch' says so).", board.update_freq, board.profile_batch)
        return None

    def check(self, validates: bool) -> None:
        """Before any worker starts, what Keras' callbacks would raise during the fit: SwapEMAWeights without
        an optimizer that keeps moving averages raises Keras' ValueError (at the first validation, or the
        first epoch's end with ``swap_on_epoch``, in Keras)."""
        import keras

        for cb in self.user:
            if isinstance(cb, keras.callbacks.SwapEMAWeights) and (validates or cb.swap_on_epoch):
                opt = self.model.optimizer
                if not any(uses_ema(o) for o in getattr(opt, "optimizers", [opt])):
                    # Keras' own checks, which raise its ValueError before anything is swapped (Keras 3.14's
                    # _swap_variables holds them; 3.15 moved them into _apply_to_ema_optimizers)
                    swap = getattr(cb, "_apply_to_ema_optimizers", None)
                    try:
                        if swap is not None:
                            swap(_nothing, _nothing)
                        else:
                            cb._swap_variables()
                    except ValueError as exc:  # IPython shows Keras' sentence, not this check's traceback
                        exc._render_traceback_ = lambda exc=exc: [f"{type(exc).__name__}: {exc}"]
                        raise exc.with_traceback(None) from None

    def begin(self) -> float | None:
        """Before the workers start: on_train_begin, on_epoch_begin(initial); the first epoch's rate.

        BackupAndRestore's on_train_begin loads its backup into the model and moves the first epoch
        (``model._initial_epoch``, which Keras' fit reads right after): ``initial_epoch`` follows it."""
        self.model.stop_training = False
        self.list.on_train_begin()
        restored = getattr(self.model, "_initial_epoch", None)
        if restored:
            self.initial_epoch = int(restored)
        self.list.on_epoch_begin(self.initial_epoch)
        return learning_rate(self.model)

    def epoch_end(self, epoch: int, logs: dict[str, Any], directions: dict[str, str] | None = None) -> Decision:
        """Run the epoch's end with merged logs (its validation's hooks first, where it validated); the
        decision every worker applies before going on. ``directions``: the compiled metrics' (the workers')."""
        logs = dict(logs)
        self._settle_monitors(directions or {})
        validation = {k[len("val_"):]: v for k, v in logs.items() if k.startswith("val_")}
        if validation:
            self.list.on_test_begin()
            self.list.on_test_end(validation)
        self.list.on_epoch_end(epoch, logs)
        self._last_logs = logs
        stop = bool(getattr(self.model, "stop_training", False))
        if not stop and epoch + 1 < self.epochs:
            self.list.on_epoch_begin(epoch + 1)
            stop = bool(getattr(self.model, "stop_training", False))
        return Decision(epoch, stop, learning_rate(self.model))

    def _settle_monitors(self, directions: dict[str, str]) -> None:
        """Whether each monitoring callback in mode "auto" (EarlyStopping, ModelCheckpoint, ReduceLROnPlateau)
        maximises its metric, decided by Keras' own rule before its first epoch end. That rule looks among the
        model's built metrics, and the notebook's model never ran a step: it reads the workers' (``directions``)
        instead, so ``monitor="val_accuracy"`` maximises, and a metric no model has raises Keras' ValueError."""
        from keras.src.callbacks.monitor_callback import MonitorCallback
        from keras.src.trainers.compile_utils import MetricsList

        for cb in self.user:
            if not isinstance(cb, MonitorCallback) or cb.monitor_op is not None or cb.mode != "auto":
                continue
            built = MetricsList([_Direction(name, way) for name, way in directions.items()])
            cb.set_model(_BuiltMetrics([built]))
            try:
                cb._set_monitor_op()
            finally:
                cb.set_model(self.model)

    def end(self) -> None:
        """After the final weights are in the model (EarlyStopping may then restore its best)."""
        if self.ended:
            return
        self.ended = True
        self.list.on_train_end(self._last_logs)


class _Direction:
    """A built metric as Keras' monitor rule reads it: its name and direction."""

    def __init__(self, name: str, direction: str) -> None:
        self.name, self._direction = name, direction


class _BuiltMetrics:
    """A model as Keras' monitor rule reads it: its metrics."""

    def __init__(self, metrics: list[Any]) -> None:
        self.metrics = metrics


def _nothing(optimizer: Any) -> None:
    """A swap that swaps nothing: SwapEMAWeights' own checks run, and raise, around it."""


def reads_logs_only(callback: Any) -> bool:
    """A Keras callback (its exact class) that never reads the model's weights at an epoch's end."""
    import keras

    cbs = keras.callbacks
    plain = (cbs.History, cbs.CSVLogger, cbs.LearningRateScheduler, cbs.ReduceLROnPlateau, cbs.TerminateOnNaN,
             cbs.ProgbarLogger, cbs.RemoteMonitor)
    if type(callback) in plain:
        return True
    # EarlyStopping keeps copies of the best weights only when asked to restore them.
    return type(callback) is cbs.EarlyStopping and not callback.restore_best_weights


def learning_rate(model: Any) -> float | None:
    import keras

    lr = getattr(getattr(model, "optimizer", None), "learning_rate", None)
    if lr is None or not hasattr(lr, "assign"):  # a schedule: the workers' copies follow it themselves
        return None
    return float(keras.ops.convert_to_numpy(lr))
