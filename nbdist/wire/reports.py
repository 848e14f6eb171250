"""What a worker tells the driver (and a Spark task its backend): one frozen dataclass per message.

Each is built where it is sent and read where it is received through its fields; ``encode`` and
``decode`` (wire/codec.py) are the only code that touches its JSON body or counts its arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .codec import MessageError, MessageType, Typed, array, arrays


@dataclass(frozen=True)
class Hello(Typed):
    """A worker's first message on its connection."""

    TYPE = MessageType.HELLO
    rank: int
    pid: int
    host: str


@dataclass(frozen=True)
class Store(Typed):
    """Where rank 0's Gloo store listens, or (``path``) the directory it made to meet in on one machine (the
    driver relays it as ``Rendezvous``)."""

    TYPE = MessageType.STORE
    host: str
    port: int
    path: str = ""


@dataclass(frozen=True)
class Progress(Typed):
    """Where a worker is: its state and, when it says, its position and timing (None: unchanged)."""

    TYPE = MessageType.PROGRESS
    state: str  # "starting", "training", "evaluating", "predicting"
    epoch: int | None = None
    batch: int | None = None
    batches: int | None = None
    samples_done: int | None = None  # over the whole run
    compute_seconds: float | None = None
    sync_seconds: float | None = None
    device: str | None = None  # where it trains: "GPU 0 (NVIDIA H200)" or "CPU"


@dataclass(frozen=True)
class State(Typed):
    """A sampled phase (worker/phases.py): training or synchronising, and the time spent in each."""

    TYPE = MessageType.STATE
    state: str
    sync_seconds: float
    compute_seconds: float

    def as_progress(self) -> Progress:
        return Progress(self.state, sync_seconds=self.sync_seconds, compute_seconds=self.compute_seconds)


@dataclass(frozen=True)
class Epoch(Typed):
    """An epoch's end on one worker: its logs on its shard and the rows behind them. A metric whose result
    is an array (``F1Score`` per class) is in ``array_logs`` under its name in ``array_names``: History keeps
    it as Keras' does, array, dtype and all."""

    TYPE = MessageType.EPOCH
    epoch: int
    logs: dict[str, float | None]
    samples: int
    val_samples: int
    seconds: float  # the worker's own epoch time (start-up is not billed to epoch 1)
    # The position at the epoch's end, as a Progress says it (the async path leaves them unchanged).
    batch: int | None = None
    batches: int | None = None
    samples_done: int | None = None
    compute_seconds: float | None = None
    sync_seconds: float | None = None
    array_names: list[str] = field(default_factory=list)
    array_logs: list[np.ndarray] = arrays()
    # Each compiled metric's direction ("up" or "down") by name, as the worker's built model holds them: what a
    # notebook's EarlyStopping or ModelCheckpoint in mode "auto" reads to tell a metric to maximise.
    directions: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        if len(self.array_names) != len(self.array_logs):
            raise MessageError(f"an epoch message has {len(self.array_logs)} array results for "
                               f"{len(self.array_names)} names")

    @property
    def all_logs(self) -> dict[str, Any]:
        """Every log of the epoch: the scalar ones, then the array results."""
        return {**self.logs, **dict(zip(self.array_names, self.array_logs))}

    def as_progress(self) -> Progress:
        return Progress("training", self.epoch, self.batch, self.batches, self.samples_done, self.compute_seconds,
                        self.sync_seconds)


@dataclass(frozen=True)
class Weights(Typed):
    """Rank 0's synchronised state after ``epoch``: the model's weights (``get_weights()`` order), then every
    optimizer's variables, where each optimizer's are among them (``layout``) and the step count; ``buffers``:
    its torch modules' buffers (model/tensors.py ``module_buffers``), which Keras keeps no variable for."""

    TYPE = MessageType.WEIGHTS
    epoch: int
    iterations: int | None
    layout: list[list[int]]
    weights: list[np.ndarray] = arrays()
    optimizer: list[np.ndarray] = arrays()
    buffers: list[np.ndarray] = arrays()


@dataclass(frozen=True)
class Done(Typed):
    """A worker's closing report. Every field is optional: each kind of job reports what it knows."""

    TYPE = MessageType.DONE
    # every job
    tensorflow_loaded: bool | None = None
    # evaluation and prediction
    seconds: float | None = None
    # training (averaging, allreduce, async)
    device: str | None = None
    sync_seconds: float | None = None
    rounds: int | None = None
    summed_by: str | None = None  # None where nothing was summed (one allreduce worker)
    engine: str | None = None  # allreduce
    padded_steps: int | None = None  # allreduce
    keras_backend: str | None = None
    optional_imports: list[str] | None = None
    last_epoch: int | None = None  # with the notebook's callbacks' decisions
    learning_rates: list[float] | None = None  # with decisions: the rate each epoch trained with
    phase_times: list[dict[str, float]] | None = None  # the run's phase_times (worker/phases.py)
    weights_sent: int | None = None  # rank 0
    async_pushed: int | None = None  # --strategy async
    async_refused: int | None = None
    async_wait_seconds: float | None = None
    async_read_seconds: float | None = None
    validation_seconds: float | None = None

    def report(self) -> dict[str, Any]:
        """The report as the run keeps it (``job.reports``): the fields this worker gave. A synchronous
        training's ``summed_by`` and a decision's ``last_epoch`` are there even when None."""
        kept = set()
        if self.rounds is not None:
            kept.add("summed_by")
        if self.learning_rates is not None:
            kept.add("last_epoch")
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) is not None or f.name in kept}


@dataclass(frozen=True)
class WorkerError(Typed):
    """A worker failed: the exception's type name, its one-line summary and the traceback text. Where Keras,
    TensorFlow or the cell's code raised it (not nbdist), also the type as ``module:qualname`` and its own
    whole message: the notebook raises that type again (driver/failures.py); else both are None."""

    TYPE = MessageType.ERROR
    exception: str
    message: str
    traceback: str
    raised_type: str | None = None
    raised_message: str | None = None


@dataclass(frozen=True)
class Lost(Typed):
    """An elastic run (worker/elastic.py): this worker's collective of ``generation`` broke. It holds its
    commit after ``committed`` epochs and ``step`` steps of the next (its in-memory copy of the whole state)
    and had run ``steps_lost`` steps past it; it waits for the driver's next job (the new generation) or its
    stop. The error it saw is sent as a ``WorkerError``'s fields: the driver raises it when no worker was lost (a
    real failure, driver/training.py). ``committed`` -1: a worker that joined this generation broke before it
    received the state: it holds none."""

    TYPE = MessageType.LOST
    generation: int
    committed: int
    steps_lost: int
    exception: str
    message: str
    traceback: str
    raised_type: str | None = None
    raised_message: str | None = None
    step: int = 0  # steps of epoch ``committed`` (counted from 0) the commit holds: 0 at an epoch start

    def error(self) -> WorkerError:
        return WorkerError(self.exception, self.message, self.traceback, self.raised_type, self.raised_message)


@dataclass(frozen=True)
class AtCommit(Typed):
    """An elastic run (worker/elastic.py): asked by ``JoinAtCommit``, every member of ``generation`` stopped at
    the same commit, after ``committed`` epochs and ``step`` steps of the next, so that the workers waiting can
    join there. Nothing was lost (its model is its commit); it waits for the next generation's job, as after
    ``Lost``."""

    TYPE = MessageType.AT_COMMIT
    generation: int
    committed: int
    step: int = 0

    @property
    def steps_lost(self) -> int:
        return 0


@dataclass(frozen=True)
class WorkerWarning(Typed):
    """Something worth saying once, not fatal (e.g. workers sharing a GPU sum through host memory)."""

    TYPE = MessageType.WARNING
    message: str


@dataclass(frozen=True)
class AsyncPull(Typed):
    """--strategy async, at an epoch's start: the shared weights and a block of batches, please. The first
    pull of the run carries every weight of the model as the job made it (the shared model's start)."""

    TYPE = MessageType.ASYNC_PULL
    epoch: int
    first: bool = False
    weights: list[np.ndarray] = arrays()


@dataclass(frozen=True)
class AsyncPush(Typed):
    """--strategy async: a block's delta from the shared weights of ``version`` it started from."""

    TYPE = MessageType.ASYNC_PUSH
    seq: int
    version: int
    samples: int
    epoch: int
    delta: list[np.ndarray] = arrays()


@dataclass(frozen=True)
class Evaluation(Typed):
    """A shard's additive metric state (``names`` the metric variables' paths, ``state`` their values), one
    label row and its prediction where the driver needs them (Spark data), and the classifier's counts."""

    TYPE = MessageType.EVALUATION
    rows: int
    names: list[str] = field(default_factory=list)
    state: list[np.ndarray] = arrays()
    y_row: np.ndarray | None = array()
    y_pred_row: np.ndarray | None = array()
    confusion: np.ndarray | None = array()
    histogram: np.ndarray | None = array()

    def check(self) -> None:
        if len(self.names) != len(self.state):
            raise MessageError(f"an evaluation message has {len(self.state)} state arrays for "
                               f"{len(self.names)} metric variables")
        if self.histogram is not None and self.confusion is None:
            raise MessageError("an evaluation message has a histogram without its confusion matrix")

    @property
    def stats(self) -> dict[str, np.ndarray] | None:
        """The classifier's counts, as metrics.merge_classifier_stats takes them (None: none sent)."""
        if self.confusion is None:
            return None
        out = {"confusion": self.confusion}
        if self.histogram is not None:
            out["histogram"] = self.histogram
        return out


@dataclass(frozen=True)
class Predictions(Typed):
    """A shard's predictions, rows in order, flattened (``layout``: data.flatten's) as ``model.predict``
    returns them; a PyDataset share also gives each of its batches' rows."""

    TYPE = MessageType.PREDICTIONS
    rows: int
    layout: Any = "array"
    outputs: list[np.ndarray] = arrays()
    batch_rows: list[int] | None = None


# -- a Spark barrier task -> the Spark backend's status server ----------------------
@dataclass(frozen=True)
class TaskStarted(Typed):
    TYPE = MessageType.TASK_STARTED
    rank: int
    pid: int
    host: str
    warm: bool = False  # a warm worker was taken (spark/warm.py)
    threads: int = 0  # the thread budget the task gave its worker (on a cluster: the task's CPUs); 0: not said


@dataclass(frozen=True)
class TaskRows(Typed):
    """The rows of the partition the task wrote for its worker (and of its validation share)."""

    TYPE = MessageType.TASK_ROWS
    rank: int
    rows: int
    val_rows: int = 0


@dataclass(frozen=True)
class TaskExit(Typed):
    """How the task's worker ended: its exit code and log tail, and as the task saw it (procs.reap)."""

    TYPE = MessageType.TASK_EXIT
    rank: int
    code: int
    log: str
    at: float
    error: str = ""
    oom_killed: bool = False
    peak_rss: int | None = None
