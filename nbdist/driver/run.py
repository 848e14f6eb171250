"""A run as the driver sees it: start workers, send each its job, follow them, finish.

``Run`` owns the coordinator and the backend and does what every kind of run does: launch,
pump events, check the workers' health, stop, shut down, notify listeners, pump on a
background thread, hold interrupts while stopping. Its subclasses (driver/training.py
``TrainingJob``, driver/inference.py ``EvaluationJob`` / ``PredictionJob``) say only what
differs: the job message, the messages they expect back, and what an ending keeps.

Events are consumed by whichever thread calls ``wait()`` (the notebook's main thread in
blocking mode), so a kernel interrupt lands here and stops every worker.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Self

from ..backends import Backend, WorkerHandle
from ..config import TrainConfig
from ..data.inputs import FitData, PyDatasetData
from ..data.sharding import batches_per_epoch, check_workers, shard_bounds
from ..errors import NbdistError, TrainingFailed
from ..machine.placement import threads_per_worker
from ..model.spec import ModelSpec
from ..spark.data import SparkData
from ..wire import protocol
from ..wire.messages import JobMessage
from ..wire.reports import Done, Progress, State, WorkerError, WorkerWarning
from .coordinator import Coordinator, Event
from .failures import describe_exit, first_line, last_traceback, peer_symptom, rebuild
from .health import HealthChecks
from .interrupts import interrupts_held, interrupts_noted
from .resolve import resolve_backend, resolve_world
from .state import TERMINAL, RunState

log = logging.getLogger(__name__)


Listener = Callable[[str, RunState, Any], None]

class Run(HealthChecks):
    """Workers started for one job: ``.status``, ``.wait()``, ``.stop()``, ``.state``, ``.reports``."""

    # The sentence for Spark data given to another backend; subclasses say what they do with it.
    spark_data_needs_spark = ("a Spark DataFrame or RDD runs on the Spark backend; use --backend spark "
                              "(or auto with the SparkContext active), or convert it to numpy first.")
    data_name = "data"  # what the run's data is to the user, in its sentences

    def __init__(self, model: Any, config: TrainConfig, data: FitData | SparkData,
                 namespace: dict[str, Any] | None = None, listeners: list[Listener] | None = None) -> None:
        self.model = model
        self.config = config
        self.data = data
        self.listeners = list(listeners or [])
        self.state: RunState | None = None
        self.world_size = 0
        # Each worker's closing report (its "done" message): rounds, engine, how gradients were summed.
        self.reports: dict[int, dict[str, Any]] = {}
        self._namespace = namespace
        self._spec: ModelSpec | None = None
        # [start, end) of each rank's rows; None until a Spark run's tasks have counted their partitions
        self._shards: list[tuple[int, int]] | None = None
        self._held: set[int] = set()  # connected workers whose job waits for those counts
        self._backend: Backend | None = None
        self._coordinator: Coordinator | None = None
        self._handles: list[WorkerHandle] = []
        self._done: set[int] = set()
        self._closing: dict[int, float] = {}  # rank -> when its connection closed
        self._exited: dict[int, float] = {}  # rank -> when its process was first seen to exit with 0
        self._left: set[int] = set()  # workers an elastic run went on without (training.py, membership.py)
        self._silent: dict[int, float] = {}  # workers silent past heartbeat_timeout, by rank: for how long
        self._awaiting_cause = False  # health.py _cause_reported: handling events while a cause may come
        self._failure: BaseException | None = None  # what wait() raises
        self._warned: set[str] = set()
        self._launched_at = 0.0
        self._pump_thread: threading.Thread | None = None
        self._stop_request: str | None = None
        self._end_pump = False  # end_pump(): the current pump returns after the event being handled

    # -- what a kind of run says (subclasses) ---------------------------
    def _make_spec(self) -> ModelSpec:
        """The model as it travels to the workers."""
        raise NotImplementedError

    def _job_message(self, rank: int) -> JobMessage:
        """Worker ``rank``'s job."""
        raise NotImplementedError

    def _prepare(self) -> None:
        """Checks and plans once the world size is known, before the run state exists."""

    def _shards_known(self, batches: list[int]) -> None:
        """Each worker's batches per epoch, once its rows are known (at start, or counted by Spark tasks)."""

    def _new_state(self, backend: Backend) -> RunState:
        return RunState(self.world_size, self.config.epochs, backend=backend.name,
                        strategy=self.config.strategy or "allreduce")

    def _seed_state(self, state: RunState) -> None:
        """Fill a new run state (e.g. a resumed run's history)."""

    def _batch_sizes(self) -> list[int]:
        """Each rank's batch size."""
        return [self.config.batch_size] * self.world_size

    def _on_message(self, rank: int, msg: Any) -> bool:
        """Handle a typed message (wire/reports.py) only this kind of run expects; True when handled."""
        return False

    def _holding(self) -> bool:
        """True while the run handles no more events this pump (e.g. a restart is pending)."""
        return False

    def _after_pump(self) -> None:
        """Work a pump leaves for after its events (e.g. a restart)."""

    def _intercept_failure(self, rank: int | None, message: str, worker_traceback: str) -> bool:
        """True when the run deals with a failure itself (e.g. restarts from a checkpoint)."""
        return False

    def _before_stop(self) -> None:
        """A stop's first step, while the workers still run (training fetches the last weights)."""

    def _keep_results(self) -> None:
        """On done or stop: what the workers produced goes back to the notebook (e.g. weights)."""

    def _on_done(self) -> None:
        """After ``_keep_results`` when every worker finished (e.g. the notebook's callbacks' end)."""

    def _release(self) -> None:
        """On every ending, and when a launch fails: remove what the run made (e.g. temp checkpoints)."""

    def _after_failure(self, message: str) -> str:
        """The failure's sentence, with what it left in the notebook (e.g. the model untouched)."""
        return message

    # -- public ---------------------------------------------------------
    @property
    def status(self) -> str:
        return self.state.status if self.state else "created"

    @property
    def history(self) -> dict[str, list[float]]:
        return self.state.history if self.state else {}

    @property
    def error(self) -> BaseException | None:
        return self._failure

    def start(self) -> Self:
        """Validate, serialise the model and launch the workers (from the main thread)."""
        cfg = self.config
        self._spec = self._make_spec()
        backend = resolve_backend(cfg)
        world, world_note = resolve_world(cfg, backend, self._world_limits(), self.data_name)
        shards = self._plan_shards(backend, world)
        self._check_collectives(backend, world)
        self.world_size = world
        self._prepare()
        self.state = self._new_state(backend)
        self.state.world_note = world_note or ""
        self._seed_state(self.state)
        self._shards = None
        if shards is not None:
            self._apply_shards(shards)
        try:
            self._launch(backend)
        except Exception:
            self._release()
            raise
        self._notify("start")
        return self

    def _check_collectives(self, backend: Backend, world: int) -> None:
        """A package the workers' collectives need and this Python lacks, said before any worker starts
        (training only; local workers run this Python, so what it lacks they lack)."""

    def _world_limits(self) -> dict[str, int]:
        """What bounds this run's world (``data.sharding.run_world``): in-memory rows, one or more per worker.
        Spark data is counted by its tasks, after launch (``_take_counts``)."""
        return {"rows": len(self.data)} if isinstance(self.data, FitData) else {}

    def _plan_shards(self, backend: Backend, world: int) -> list[tuple[int, int]] | None:
        """Each rank's rows; None for Spark data, whose tasks count their partitions (``_take_counts``)."""
        if isinstance(self.data, SparkData):  # stays on the executors; its tasks count the rows
            if backend.name != "spark":
                raise NbdistError(self.spark_data_needs_spark)
            return None
        return shard_bounds(len(self.data), world)

    def _apply_shards(self, shards: list[tuple[int, int]]) -> None:
        """Each worker's rows (start, end): its epoch's batches, in the run state and for the subclass."""
        self._shards = shards
        batches = [batches_per_epoch(b - a, size) for (a, b), size in zip(shards, self._batch_sizes())]
        for w, (a, b), n in zip(self.state.workers, shards, batches):
            w.samples, w.batches = b - a, n
        self._shards_known(batches)

    def _take_counts(self) -> None:
        """Spark data: once every task has counted the partition it read, size the shards and send
        the jobs held back meanwhile (counted by the tasks, so they match what the workers load)."""
        if self._shards is not None or self.status in TERMINAL:
            return
        rows = self._backend.partition_rows()
        if rows is None:
            return
        try:
            check_workers(sum(rows), self.world_size)
        except NbdistError as exc:
            self._fail(None, str(exc), "")
            return
        self._apply_shards([(sum(rows[:r]), sum(rows[:r + 1])) for r in range(len(rows))])
        for rank in sorted(self._held):
            self._send_job(rank)
        self._held.clear()
        self._notify("worker")

    def _launch(self, backend: Backend) -> None:
        """A fresh coordinator (new secret) and ``world_size`` workers from ``backend``."""
        world = self.world_size
        secret = protocol.new_secret()
        self._coordinator = Coordinator(secret, world, backend.bind_host, backend.advertise_host,
                                        self.config.heartbeat_interval)
        self._backend = backend
        self._held = set()
        if self.data_on_tasks:
            self._shards = None  # a relaunch reads the partitions afresh
        self._launched_at = time.monotonic()
        data = self.data if self.data_on_tasks else None
        if data is not None:  # shares within a batch of each other are equal enough to read as they are
            data.batch = min(self._batch_sizes())
        try:
            self._handles = backend.launch(world, self._coordinator.address, secret, self._threads(),
                                           data=data)
        except Exception:
            self._shutdown()
            raise
        self.state.data_note = getattr(backend, "data_note", "")  # e.g. how Spark data was rebalanced

    def _threads(self) -> int:
        """Each worker's thread budget: its share of this machine's cores, which local workers split
        with the other runs sharing it (``local_share``: a search's parallel trials)."""
        return threads_per_worker(self.world_size * (self.config.local_share if self._local else 1))

    def _slots(self) -> list[int]:
        """The workers by rank: their launch ranks (an elastic run's generation maps them: training.py)."""
        return list(range(self.world_size))

    def _worker_threads(self, rank: int) -> int:
        """Worker ``rank``'s thread budget: the one its launcher gave it where that knows better (a Spark task on
        a cluster: the task's CPUs, ``SparkTaskWorker.threads``), else ``_threads``."""
        slots = self._slots()
        handle = self._handles[slots[rank]] if rank < len(slots) and slots[rank] < len(self._handles) else None
        told = getattr(handle, "told_threads", None)
        return (told() if told is not None else 0) or self._threads()

    @property
    def _local(self) -> bool:
        """The workers are local processes: they share this machine's cores and filesystem."""
        return self._backend is not None and self._backend.name == "local"

    @property
    def data_on_tasks(self) -> bool:
        """The data lives on Spark executors: each worker's task writes its shard, none travels."""
        return isinstance(self.data, SparkData)

    def _file_rows(self, rank: int) -> dict[str, Any] | None:
        """Where local worker ``rank`` reads its features itself from the notebook's memory-mapped .npy
        (``data.NpyFile``), else None: they cross the wire."""
        return None

    def _x_file(self) -> Any:
        """The notebook's memory-mapped .npy that ``x`` is, when the workers are local (same filesystem)."""
        return self.data.x_file if self._local and isinstance(self.data, FitData) else None

    def _x_leaves(self) -> dict[int, Any]:
        """The inputs of a dict or list ``x`` that are memory-mapped .npy files, when the workers are local:
        each worker reads its rows of them from the file (``leaves_rows``); the other inputs cross the wire."""
        return self.data.x_leaves if self._local and isinstance(self.data, FitData) else {}

    def _shard(self, rank: int) -> FitData | None:
        """Rank ``rank``'s rows from the driver's data; None when its Spark task reads them."""
        if self.data_on_tasks:
            return None
        a, b = self._shards[rank]
        files = self._x_leaves()
        return self.data.slice(a, b).without_x_leaves(files) if files else self.data.slice(a, b)

    def _common_job(self, rank: int, kind: str, **fields: Any) -> JobMessage:
        """The job fields every kind of run fills the same way, plus ``fields``."""
        shard = self._shard(rank)
        x, y, weights = data_parts(shard)
        data_file = self._file_rows(rank)
        some_inputs = data_file is not None and "leaves" in data_file  # the rest of x crosses the wire
        source = "task" if self.data_on_tasks else "file" if data_file is not None and not some_inputs else "wire"
        if data_file is not None and not some_inputs:  # the notebook's memory map: the worker reads its rows
            x = None
        return JobMessage(
            kind=kind, rank=rank, world_size=self.world_size, batch_size=self.config.batch_size,
            heartbeat_timeout=self.config.heartbeat_timeout, threads=self._worker_threads(rank),
            model=self._spec, x=x, y=y, sample_weight=weights, data_source=source, data_file=data_file,
            has_y=shard is None or y is not None, **fields)

    def wait(self, timeout: float | None = None) -> dict[str, list[float]]:
        """Follow the run until it ends. Raises TrainingFailed, or what Keras or the cell's code raised (on a
        worker, or a notebook callback) as itself; on interrupt stops every worker."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with interrupts_noted() as pressed:  # an interrupt acted on between steps: never lost (interrupts.py)
            try:
                while self.status not in TERMINAL:
                    if pressed:
                        raise KeyboardInterrupt
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"training still running after {timeout} s")
                    if self._in_background():
                        self._pump_thread.join(0.2)  # the pump thread handles the events
                    else:
                        self.pump(0.2)
            except KeyboardInterrupt:
                self.stop("interrupted")
                raise
        if self._failure is not None:
            raise self._failure
        return self.history

    def stop(self, reason: str = "stopped") -> None:
        """End every worker now; the model keeps the last synchronised weights.

        An interrupt pressed again meanwhile is held back until the stop is complete: a stop
        cut short would leave workers running and the model half-written."""
        with interrupts_held():
            self._stop_once(reason)

    def _stop_once(self, reason: str) -> None:
        if self.status in TERMINAL:
            return
        if self._in_background():
            # Only the pump thread touches the coordinator: ask it, then wait for it to finish.
            self._stop_request = reason
            self._pump_thread.join(self.config.startup_timeout)
            return
        self._before_stop()
        self._shutdown()
        if not self._kept_results():
            return
        self._release()
        self.state.finish("stopped", reason)
        self._notify("end")

    def run_in_background(self) -> Self:
        """Pump events on a daemon thread; ``start()`` must have run on the calling thread, because
        workers die with the thread that spawned them (PR_SET_PDEATHSIG)."""
        if self.state is None:
            raise NbdistError("start() the job before run_in_background().")
        self._pump_thread = threading.Thread(target=self._pump_until_end, name="nbdist-pump", daemon=True)
        self._pump_thread.start()
        return self

    def _in_background(self) -> bool:
        t = self._pump_thread
        return t is not None and t.is_alive() and threading.current_thread() is not t

    def _pump_until_end(self) -> None:
        try:
            while self.status not in TERMINAL:
                if self._stop_request is not None:
                    self.stop(self._stop_request)
                    break
                self.pump(0.2)
        except Exception as exc:  # never leave workers running behind a dead thread
            log.exception("the background event loop failed")
            if self.status not in TERMINAL:
                self.stop(f"internal error: {exc}")

    def end_pump(self) -> None:
        """From a listener: the pump handling this event returns right after it, leaving later events
        queued, so whoever pumps can act first (a search stops a pruned trial before its next epoch)."""
        self._end_pump = True

    def worker_log(self, rank: int, lines: int = 20) -> str:
        """The last lines worker ``rank`` wrote to stdout/stderr."""
        return self._handles[rank].log_tail(lines) if rank < len(self._handles) else ""

    # -- event loop -----------------------------------------------------
    def pump(self, timeout: float) -> None:
        """Handle the events that arrive within ``timeout`` seconds, then check worker health."""
        assert self._coordinator is not None
        end = time.monotonic() + timeout
        self._end_pump = False
        while self.status not in TERMINAL and not self._holding():
            try:
                event = self._coordinator.events.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            self._handle(event)
            if self._end_pump:  # a listener wants to act (e.g. stop the run) before any later event
                return
        if self.status not in TERMINAL and not self._holding():
            self._take_counts()
        if self.status not in TERMINAL and not self._holding():
            self._check_health()
        self._after_pump()

    def _handle(self, event: Event) -> None:
        if event.kind == "connected":
            self._closing.pop(event.rank, None)  # an earlier connection for this rank hung up: this one replaces it
            hello = event.message
            self.state.worker_connected(event.rank, hello.host, hello.pid)
            if self._shards is None:
                self._held.add(event.rank)
                self._take_counts()
            else:
                self._send_job(event.rank)
            self._notify("worker")
        elif event.kind == "closed":
            if event.rank not in self._done:
                self._closing[event.rank] = time.monotonic()
        else:
            self._handle_message(event.rank, event.message)

    def _send_job(self, rank: int) -> None:
        try:
            self._coordinator.send(rank, self._job_message(rank))
        except (ConnectionError, OSError) as exc:
            # It hung up right after its hello: the "closed" event behind it goes to the health check,
            # which names the cause; the event loop itself must not die of it.
            log.warning("could not send the job to worker %d: %s", rank, exc)

    def _handle_message(self, rank: int, msg: Any) -> None:
        if self._on_message(rank, msg):
            return
        if isinstance(msg, (Progress, State)):  # State: a sampled phase (training / synchronising)
            self.state.worker_progress(rank, msg)
            self._notify("progress", rank)
        elif isinstance(msg, Done):
            self._done.add(rank)
            self.reports[rank] = msg.report()
            self.state.worker_finished(rank, "done")
            self._notify("worker", rank)
            if len(self._done) == self.world_size:
                self._complete()
        elif isinstance(msg, WorkerWarning):  # e.g. --engine horovod unavailable on a worker: said once, not fatal
            text = msg.message
            if text not in self._warned:
                self._warned.add(text)
                log.warning("%s: %s", self._name(rank), text)
        elif isinstance(msg, WorkerError):
            text = first_line(msg.message or msg.exception or "error")
            dead = self._dead_peer(rank)
            if dead is not None:  # a peer's death broke the collective: name the cause, not the symptom
                # The symptom's head only (a Gloo "Read error" runs to 300 characters): one short sentence.
                self._fail(dead.rank, f"{dead.describe()} {describe_exit(dead.exit_status(), dead)} during training "
                                      f"(then {self._name(rank)} failed: {first_line(text, 80)})",
                           last_traceback(dead.log_tail(400)))
                return
            # A peer's symptom: passed over while the first one waits for the cause, or the cause came and ended it.
            if peer_symptom(f"{msg.message} {msg.exception}") and (self._awaiting_cause or self._cause_reported()):
                return
            raised = None
            if msg.raised_type is not None:  # Keras' or the cell's: the notebook raises it as it is
                raised = rebuild(msg.raised_type, msg.raised_message or "", msg.traceback, rank)
            self._fail(rank, f"{self._name(rank)} failed: {text}", msg.traceback, raised)

    # -- endings --------------------------------------------------------
    def _fail(self, rank: int | None, message: str, worker_traceback: str,
              raised: BaseException | None = None) -> None:
        """End the run failed: ``wait`` raises TrainingFailed with ``message``, or ``raised`` (what Keras or
        the cell's code raised, on a worker or in a notebook callback) as it is, its message untouched: what
        was left in the model is said in the log."""
        if self._intercept_failure(rank, message, worker_traceback):
            return
        message = self._after_failure(message)
        if raised is not None:
            where = self._name(rank) if rank is not None else "a callback in the notebook"
            left = self._after_failure("").lstrip("; ")
            log.warning("%s raised %s%s", where, type(raised).__name__, f"; {left}" if left else "")
            self._failure = raised
        else:
            self._failure = TrainingFailed(message, worker_traceback, rank)
        if rank is not None:
            self.state.worker_finished(rank, "failed", worker_traceback)
        self._shutdown()
        self._release()
        self.state.finish("failed", message)
        self._notify("end")

    def _complete(self) -> None:
        self._shutdown()
        if not self._kept_results():
            return
        self._on_done()
        self._release()
        self.state.finish("done")
        self._notify("end")

    def _kept_results(self) -> bool:
        """``_keep_results``, or the run failed because what the workers made could not be kept (the
        model is then as it was: model_io.apply_state puts all of it back or none)."""
        try:
            self._keep_results()
            return True
        except Exception as exc:
            log.exception("keeping the run's results failed")
            message = (f"the workers finished, but their trained state could not be put into the notebook's "
                       f"model ({' '.join(str(exc).split())[:200]}); the model was left as it was before the run.")
            self._failure = TrainingFailed(message, "", None)
            self._release()
            self.state.finish("failed", message)
            self._notify("end")
            return False

    def _shutdown(self) -> None:
        if self._coordinator is not None:
            self._coordinator.close()
        if self._backend is not None:
            self._backend.stop()
            self._backend.cleanup()

    def _name(self, rank: int) -> str:
        return self._handles[rank].describe() if rank < len(self._handles) else f"worker {rank}"

    def _notify(self, kind: str, payload: Any = None) -> None:
        for listener in self.listeners:
            try:
                listener(kind, self.state, payload)
            except Exception:  # a broken renderer must not break training
                log.exception("progress listener failed")


def data_parts(data: FitData | None) -> tuple[Any, Any, Any]:
    """(x, y, sample weights) of a shard."""
    if data is None or isinstance(data, PyDatasetData):  # a PyDataset travels whole (TrainingJob)
        return None, None, None
    return data.x, data.y, data.sample_weight
