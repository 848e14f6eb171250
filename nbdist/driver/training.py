"""A training run as the driver sees it: start workers, feed them, follow them, finish.

``TrainingJob`` owns the coordinator and the backend. Events are consumed by
whichever thread calls ``wait()`` (the notebook's main thread in blocking mode),
so a kernel interrupt lands here and stops every worker.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..backends import Backend, WorkerHandle
from ..checks import non_finite, non_finite_message
from ..config import TrainConfig
from ..data import Dataset, batches_per_epoch, check_workers, shard_bounds
from ..errors import NbdistError, TrainingFailed
from ..model_io import ModelSpec, build_optimizer, set_optimizer_weights, spec_from_model
from ..placement import threads_per_worker
from ..spark.data import SparkData
from ..strategies.averaging import rounds_per_epoch
from ..wire import protocol
from .coordinator import Coordinator, Event
from .keeper import CheckpointKeeper
from .resolve import resolve_backend
from .state import RunState

log = logging.getLogger(__name__)

TERMINAL = ("done", "failed", "stopped")
# How long after a worker's connection drops we wait for its process to report an exit code.
EXIT_GRACE = 2.0


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _raised(worker_traceback: str) -> str:
    """': <the exception>' from a worker's traceback (its last line), so the message says why."""
    if not worker_traceback.startswith("Traceback"):
        return ""
    lines = [line.strip() for line in worker_traceback.strip().splitlines() if line.strip()]
    return f": {_first_line(lines[-1])}" if len(lines) > 1 else ""


def _first_line(text: str, limit: int = 200) -> str:
    """The head of an exception message: the whole of it is in the worker's traceback."""
    line = text.strip().splitlines()[0] if text.strip() else "error"
    return line if len(line) <= limit else line[: limit - 3] + "..."


def last_traceback(log_text: str, fallback_lines: int = 30) -> str:
    """The last whole Python traceback in a worker's log, else the log's last lines.

    A worker logs its traceback before it exits; TensorFlow's can run to hundreds of lines,
    so a fixed-size tail would cut off its head ("Traceback (most recent call last)").
    """
    start = log_text.rfind("Traceback (most recent call last)")
    if start >= 0:
        return log_text[start:]
    return "\n".join(log_text.splitlines()[-fallback_lines:])


class TrainingJob:
    """One run of ``nbdist.train``: ``.status``, ``.history``, ``.wait()``, ``.stop()``."""

    def __init__(self, model: Any, config: TrainConfig, train: Dataset, validation: Dataset | None = None,
                 namespace: dict[str, Any] | None = None,
                 listeners: list[Callable[[str, RunState, Any], None]] | None = None) -> None:
        self.model = model
        self.config = config
        self.train_data = train
        self.validation_data = validation
        self.listeners = list(listeners or [])
        self._namespace = namespace
        self._backend: Backend | None = None
        self._coordinator: Coordinator | None = None
        self._handles: list[WorkerHandle] = []
        self._spec: ModelSpec | None = None
        self._last_weights: tuple[int, list[np.ndarray], int] | None = None
        self._iterations: int | None = None
        self._done: set[int] = set()
        # Each worker's closing report (its "done" message): rounds, engine, how gradients were summed.
        self.reports: dict[int, dict[str, Any]] = {}
        self._closing: dict[int, float] = {}
        self._failure: TrainingFailed | None = None
        self._warned: set[str] = set()
        self._launched_at = 0.0
        self.state: RunState | None = None
        self.world_size = 0
        self._pump_thread: threading.Thread | None = None
        self._stop_request: str | None = None
        self._keeper: CheckpointKeeper | None = None  # --checkpoint-dir / --resume / --max-restarts
        self._restart_pending: tuple[int, str, str] | None = None
        self._initial_epoch = 0
        # An intercepted model.fit (or nbdist.train with fit's arguments): its data plan and the
        # notebook's callbacks, run here with merged logs (fit_call.py, callbacks.py).
        self.fit: Any = None
        self._first_lr: float | None = None

    # -- public ---------------------------------------------------------
    @property
    def status(self) -> str:
        return self.state.status if self.state else "created"

    @property
    def history(self) -> dict[str, list[float]]:
        return self.state.history if self.state else {}

    @property
    def fit_history(self) -> Any:
        """The ``keras.callbacks.History`` of an intercepted ``model.fit`` (None for a plain run)."""
        return self.fit.callbacks.history if self.fit is not None else None

    @property
    def error(self) -> TrainingFailed | None:
        return self._failure

    def start(self) -> TrainingJob:
        """Validate, serialise the model and launch the workers (from the main thread)."""
        cfg = self.config
        self._spec = self._make_spec()
        backend = resolve_backend(cfg)
        world = cfg.workers or backend.default_workers()
        shards = None
        if isinstance(self.train_data, SparkData):  # stays on the executors; its tasks count the rows
            if backend.name != "spark":
                raise NbdistError("a Spark DataFrame or RDD trains on the Spark backend; use --backend spark "
                                  "(or auto with the SparkContext active), or convert it to numpy first.")
        elif self.fit is not None:  # every global batch dealt over the workers (fitdata.deal_rows)
            check_workers(len(self.train_data), world)
            self._batch_sizes, self._rows = self.fit.plan(world, cfg.batch_size)
            shards = [(0, len(rows)) for rows in self._rows]
            self._initial_epoch = self.fit.initial_epoch
        else:
            check_workers(len(self.train_data), world)
            shards = shard_bounds(len(self.train_data), world)
        if self.fit is None:
            self._batch_sizes = [cfg.batch_size] * world
        self.world_size = world
        self._val_shards = (shard_bounds(len(self.validation_data), world)
                            if self.validation_data is not None else None)
        # Last of the checks (a temporary checkpoint directory is made here and removed by every ending).
        self._keeper = CheckpointKeeper.for_run(cfg, self.model)
        if self._keeper is not None:
            self._spec, self._initial_epoch = self._keeper.start_point(self._spec)
        self.state = RunState(world, cfg.epochs, backend=backend.name, strategy=cfg.strategy,
                              initial_epoch=self._initial_epoch)
        if self._keeper is not None:
            self._keeper.seed_state(self.state)
        self._shards = None
        if shards is not None:
            self._apply_shards(shards)
        if self.fit is not None:  # on_train_begin, on_epoch_begin: the first epoch's learning rate
            self._first_lr = self.fit.callbacks.begin()
        try:
            self._launch(backend)
        except Exception:
            self._drop_temp_checkpoints()
            raise
        self._notify("start")
        return self

    def _apply_shards(self, shards: list[tuple[int, int]]) -> None:
        """Each worker's rows (start, end): its epoch's batches and the averaging rounds all agree on."""
        cfg = self.config
        self._shards = shards
        batches = [batches_per_epoch(b - a, size) for (a, b), size in zip(shards, self._batch_sizes)]
        self._rounds = rounds_per_epoch(batches, cfg.averaging_frequency)
        for w, (a, b), n in zip(self.state.workers, shards, batches):
            w.samples, w.batches = b - a, n

    def _take_counts(self) -> None:
        """Spark data: once every task has counted the partition it read, size the shards and send
        the jobs held back meanwhile (counted by the tasks, so they match what the workers load)."""
        if self._shards is not None or self.status in TERMINAL:
            return
        rows = getattr(self._backend, "partition_rows", lambda: None)()
        if rows is None:
            return
        try:
            check_workers(sum(rows), self.world_size)
        except NbdistError as exc:
            self._fail(None, str(exc), "")
            return
        self._apply_shards([(sum(rows[:r]), sum(rows[:r + 1])) for r in range(len(rows))])
        for rank in sorted(self._held):
            self._give_job(rank)
        self._held.clear()
        self._notify("worker")

    def _launch(self, backend: Backend) -> None:
        """A fresh coordinator (new secret) and ``world_size`` workers from ``backend``."""
        world = self.world_size
        self._held: set[int] = set()  # connected workers whose job waits for the tasks' row counts
        spark_data = self.train_data if isinstance(self.train_data, SparkData) else None
        if spark_data is not None:
            self._shards = None  # a relaunch reads the partitions afresh
        secret = protocol.new_secret()
        self._coordinator = Coordinator(secret, world, backend.bind_host, backend.advertise_host,
                                        self.config.heartbeat_interval)
        self._backend = backend
        self._rendezvous: dict[str, Any] | None = None  # where rank 0's store listens, once it says
        threads = threads_per_worker(world)
        self._launched_at = time.monotonic()
        try:
            more = {"data": spark_data} if spark_data is not None else {}
            self._handles = backend.launch(world, self._coordinator.address, secret, threads, **more)
        except Exception:
            self._shutdown()
            raise

    def _make_spec(self) -> ModelSpec:
        return spec_from_model(self.model, self._namespace)

    def wait(self, timeout: float | None = None) -> dict[str, list[float]]:
        """Follow the run until it ends. Raises TrainingFailed; on interrupt stops every worker."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self.status not in TERMINAL:
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
        with _interrupts_held():
            self._stop_once(reason)

    def _stop_once(self, reason: str) -> None:
        if self.status in TERMINAL:
            return
        if self._in_background():
            # Only the pump thread touches the coordinator: ask it, then wait for it to finish.
            self._stop_request = reason
            self._pump_thread.join(self.config.startup_timeout)
            return
        self._shutdown()
        self._apply_last_weights()
        self._drop_temp_checkpoints()
        self.state.finish("stopped", reason)
        self._notify("end")

    def run_in_background(self) -> TrainingJob:
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

    def worker_log(self, rank: int, lines: int = 20) -> str:
        """The last lines worker ``rank`` wrote to stdout/stderr."""
        return self._handles[rank].log_tail(lines) if rank < len(self._handles) else ""

    def __repr__(self) -> str:
        if self.state is None:
            return f"<TrainingJob {self.status}>"
        st = self.state
        return (f"<TrainingJob {st.status}: {st.initial_epoch + st.epochs_done}/{st.epochs} epochs on "
                f"{st.world_size} {st.backend} workers>")

    # -- event loop -----------------------------------------------------
    def pump(self, timeout: float) -> None:
        """Handle the events that arrive within ``timeout`` seconds, then check worker health."""
        assert self._coordinator is not None
        end = time.monotonic() + timeout
        while self.status not in TERMINAL and self._restart_pending is None:
            try:
                event = self._coordinator.events.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                break
            self._handle(event)
        if self.status not in TERMINAL and self._restart_pending is None:
            self._take_counts()
        if self.status not in TERMINAL and self._restart_pending is None:
            self._check_health()
        if self._restart_pending is not None:
            self._restart()

    def _handle(self, event: Event) -> None:
        st = self.state
        if event.kind == "connected":
            body = event.message.body
            st.worker_connected(event.rank, str(body.get("host", "")), body.get("pid"))
            if self._shards is None:
                self._held.add(event.rank)
                self._take_counts()
            else:
                self._give_job(event.rank)
            self._notify("worker")
        elif event.kind == "closed":
            if event.rank not in self._done:
                self._closing[event.rank] = time.monotonic()
        else:
            self._handle_message(event.rank, event.message)

    def _give_job(self, rank: int) -> None:
        self._send_job(rank)
        if self._rendezvous is not None:  # rank 0 published the store before this worker came
            self._coordinator.send(rank, self._rendezvous)

    def _handle_message(self, rank: int, msg: protocol.Message) -> None:
        st, kind = self.state, msg.type
        if kind in ("progress", "state"):  # "state": a worker's sampled phase (training / synchronising)
            st.worker_progress(rank, msg.body)
            self._notify("progress", rank)
        elif kind == "epoch":
            merged = st.worker_epoch(rank, msg.body)
            if merged is not None:
                self._save_checkpoint(int(msg.body["epoch"]))
                if self.status in TERMINAL:  # the checkpoint could not be written
                    return
                self._notify("epoch", merged)
                bad = non_finite(merged)
                if bad is not None:  # diverged: stop rather than train on, and keep the user's weights
                    self._fail(rank, non_finite_message(bad, merged[bad], int(msg.body["epoch"])), "")
                elif self.fit is not None:
                    self._fit_epoch_end(int(msg.body["epoch"]), merged)
        elif kind == "weights":
            n = int(msg.body["n_weights"])
            self._last_weights = (int(msg.body["epoch"]), msg.arrays[:n], len(msg.arrays) - n)
            self._opt_weights = msg.arrays[n:]
            self._iterations = msg.body.get("iterations")
        elif kind == "store":
            # Kept for workers that connect later (a warm rank 0 can be seconds ahead of a cold
            # rank 1); one that connected but has no job yet drops this copy and gets it with its job.
            self._rendezvous = {"type": "rendezvous", "host": msg.body["host"], "port": int(msg.body["port"])}
            self._coordinator.broadcast(self._rendezvous)
        elif kind == "done":
            self._done.add(rank)
            self.reports[rank] = {k: v for k, v in msg.body.items() if k != "type"}
            st.worker_finished(rank, "done")
            self._notify("worker", rank)
            if len(self._done) == self.world_size:
                self._complete()
        elif kind == "warning":  # e.g. --engine horovod unavailable on a worker: said once, not fatal
            text = str(msg.body.get("message", ""))
            if text not in self._warned:
                self._warned.add(text)
                log.warning("%s: %s", self._name(rank), text)
        elif kind == "error":
            text = _first_line(str(msg.body.get("message", "error")))
            dead = self._dead_peer(rank)
            if dead is not None:  # a peer's death broke the collective: name the cause, not the symptom
                self._fail(dead.rank, f"{dead.describe()} {_describe_exit(dead.exit_status())} during training "
                                      f"(then {self._name(rank)} failed: {text})",
                           last_traceback(dead.log_tail(400)))
                return
            self._fail(rank, f"{self._name(rank)} failed: {text}", str(msg.body.get("traceback", "")))

    def _dead_peer(self, rank: int, wait: float = 1.0) -> WorkerHandle | None:
        """Another worker that died (its exit may be reported a moment after the error it caused)."""
        deadline = time.monotonic() + wait
        while True:
            for h in self._handles:
                code = h.exit_status()
                # Exit code 1: that worker raised and reported its own error; it is not the cause.
                if h.rank != rank and h.rank not in self._done and code is not None and code not in (0, 1):
                    return h
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _send_job(self, rank: int) -> None:
        cfg, spec = self.config, self._spec
        a, b = self._shards[rank]
        on_task = isinstance(self.train_data, SparkData)  # the worker's Spark task wrote its shard
        val = None
        if self._val_shards is not None:
            va, vb = self._val_shards[rank]
            val = self.validation_data.slice(va, vb)
        if self.fit is not None:
            shard = self.train_data.take(self._rows[rank])
            arrays, fit_extra = self.fit.job_part(spec, shard, val, self._batch_sizes, self._first_lr)
            arrays = job_arrays(spec, None, None, with_optimizer=True) + arrays
            shard, val = self.train_data, None  # the layout carries the data; has_y below is unused
        else:
            shard = None if on_task else self.train_data.slice(a, b)
            arrays = job_arrays(spec, shard, val, with_optimizer=True)
            fit_extra = {}
        body = {
            "type": "job", "rank": rank, "world_size": self.world_size,
            "config": {k: getattr(cfg, k) for k in ("epochs", "batch_size", "averaging_frequency",
                                                     "average_optimizer", "seed", "shuffle", "lr_scaling",
                                                     "heartbeat_timeout", "strategy", "engine",
                                                     "direct_sum_bytes", "shared_memory")},
            "model_config": spec.config,
            "n_weights": len(spec.weights),
            "n_optimizer": -1 if spec.optimizer_weights is None else len(spec.optimizer_weights),
            "has_custom": bool(spec.custom_objects),
            "has_y": on_task or shard.y is not None,
            "data_source": "task" if on_task else "wire",
            "store_on_link": bool(getattr(self._backend, "store_on_link", False)),
            "has_val": val is not None,
            "rounds_per_epoch": self._rounds,
            "initial_epoch": self._initial_epoch,
            "iterations": spec.iterations,
            "threads": threads_per_worker(self.world_size),
            "bind_host": self._backend.bind_host,
            "advertise_host": self._backend.advertise_host,
            "gloo_ifname": getattr(self._backend, "gloo_ifname", None),
            "sync_timeout": cfg.sync_timeout,
            # Workers without validation rows still join each epoch's sum of validation metric state.
            "validation_anywhere": self.validation_data is not None,
            "startup_timeout": cfg.startup_timeout,
        }
        if fit_extra:
            body["config"]["batch_sizes"] = fit_extra.pop("batch_sizes")
            body.update(fit_extra)
        self._coordinator.send(rank, body, arrays)

    def _check_health(self) -> None:
        now = time.monotonic()
        for h in self._handles:
            if h.rank in self._done:
                continue
            code = h.exit_status()
            closing = self._closing.get(h.rank)
            if code is not None and code != 0 or (code is None and closing and now - closing > EXIT_GRACE):
                self._drain_errors()
                if self.status in TERMINAL:
                    return
                how = _describe_exit(code) if code is not None else "closed its connection"
                if code == protocol.EXIT_UNREACHABLE:  # it never connected: where it tried, and what to change
                    host, port = self._coordinator.address
                    hint = getattr(self._backend, "unreachable_hint", "")
                    self._fail(h.rank, f"{h.describe()} cannot reach the notebook's coordinator at {host}:{port}"
                                       + (f"; {hint}." if hint else "."), h.log_tail(30))
                    return
                tb = last_traceback(h.log_tail(400))
                self._fail(h.rank, f"{h.describe()} {how} during training{_raised(tb)}", tb)
                return
            if code == 0 and h.rank not in self._done:
                self._drain_errors()
                if self.status in TERMINAL:
                    return
                self._fail(h.rank, f"{h.describe()} exited before finishing", last_traceback(h.log_tail(400)))
                return
        connected = self._coordinator.connected() | self._done | set(self._closing)
        if len(connected) < self.world_size and now - self._launched_at > self.config.startup_timeout:
            missing = sorted(set(range(self.world_size)) - connected)
            h = self._handles[missing[0]]
            self._fail(missing[0], f"{h.describe()} did not connect within {self.config.startup_timeout:.0f} s",
                       h.log_tail(30))
            return
        for rank in self._coordinator.connected():
            if self._coordinator.silent_for(rank) > self.config.heartbeat_timeout:
                self._fail(rank, f"{self._name(rank)} sent nothing for {self.config.heartbeat_timeout:.0f} s "
                                 "and is presumed hung", self._handles[rank].log_tail(30))
                return

    def _drain_errors(self) -> None:
        """A worker that raised sends its traceback before exiting: prefer that to the exit code."""
        while True:
            try:
                event = self._coordinator.events.get_nowait()
            except queue.Empty:
                return
            self._handle(event)
            if self.status in TERMINAL or self._restart_pending is not None:
                return

    # -- endings --------------------------------------------------------
    def _fail(self, rank: int | None, message: str, worker_traceback: str) -> None:
        if self._restart_pending is not None:  # the first cause is the one a restart reports
            return
        if rank is not None and self._keeper is not None and self._keeper.can_restart():
            self._restart_pending = (rank, message, worker_traceback)  # pump() restarts, after this event
            return
        self._failure = TrainingFailed(message, worker_traceback, rank)
        if rank is not None:
            self.state.worker_finished(rank, "failed", worker_traceback)
        self._shutdown()
        self._drop_temp_checkpoints()
        self.state.finish("failed", message)
        self._notify("end")

    def _fit_epoch_end(self, epoch: int, merged: dict[str, float]) -> None:
        """The notebook's callbacks see the shared weights and merged logs; their decision goes to every worker."""
        self._apply_last_weights()
        try:
            decision = self.fit.callbacks.epoch_end(epoch, merged)
        except Exception as exc:  # the notebook's own callback raised: end the run with its message
            log.exception("a callback failed at epoch %d", epoch + 1)
            self._fail(None, f"callback failed at the end of epoch {epoch + 1}: {type(exc).__name__}: {exc}", "")
            return
        if self.fit.callbacks.needs_decisions:
            for r in range(self.world_size):
                try:
                    self._coordinator.send(r, decision)
                except (ConnectionError, OSError):
                    pass  # that worker is gone: the health check names the cause

    def _complete(self) -> None:
        self._shutdown()
        self._apply_last_weights()
        if self.fit is not None:
            self.fit.callbacks.end()  # e.g. EarlyStopping restores its best weights into the model
        self._drop_temp_checkpoints()
        self.state.finish("done")
        self._notify("end")

    # -- checkpoints and restarts (logic in restarts.py / checkpoint.py) -
    def _save_checkpoint(self, epoch: int) -> None:
        if self._keeper is None:
            return
        if self._last_weights is None or self._last_weights[0] != epoch:
            log.warning("no synchronised weights for epoch %d; its checkpoint is skipped", epoch + 1)
            return
        try:
            self._keeper.save(epoch + 1, self._last_weights[1], self._opt_weights, self._iterations,
                              self.state.history, self.world_size)
        except OSError as exc:
            self._fail(None, f"could not write the checkpoint to {self._keeper.directory} ({exc}); free some "
                             "space or choose another --checkpoint-dir.", "")

    def _restart(self) -> None:
        """Tear every worker down and relaunch them all from the last checkpoint."""
        rank, message, worker_traceback = self._restart_pending
        self._shutdown()  # waits for every worker process to end
        self._restart_pending = None
        keeper = self._keeper
        self._done, self._closing = set(), {}
        try:
            self._spec, self._initial_epoch = keeper.restart_point()
            self._rewind_last_weights()
            self.state.restarting(self._initial_epoch)
            reason = keeper.restart_reason(message, self._initial_epoch)
            log.info("%s", reason)
            self._notify("restart", reason)
            self._launch(resolve_backend(self.config))
        except Exception as exc:
            self._fail(rank, f"relaunching the workers failed ({exc}) after: {message}", worker_traceback)

    def _rewind_last_weights(self) -> None:
        """What a stop before the relaunched workers finish an epoch leaves in the model: the
        checkpoint's state, not weights from an epoch that died with a worker."""
        if self._initial_epoch == 0:  # restarted from the model as given
            self._last_weights = None
            return
        opt = list(self._spec.optimizer_weights or [])
        self._last_weights = (self._initial_epoch - 1, list(self._spec.weights), len(opt))
        self._opt_weights, self._iterations = opt, self._keeper.iterations

    def _drop_temp_checkpoints(self) -> None:
        if self._keeper is not None:
            self._keeper.close()

    def _apply_last_weights(self) -> None:
        if self._last_weights is None:
            return
        _, weights, n_opt = self._last_weights
        self.model.set_weights(weights)
        if n_opt and self.config.average_optimizer:
            build_optimizer(self.model)
            set_optimizer_weights(self.model, self._opt_weights)
        if self._iterations is not None:  # Adam's bias correction and LR schedules continue, not restart
            self.model.optimizer.iterations.assign(int(self._iterations))

    @property
    def weights_epoch(self) -> int | None:
        """The epoch whose end the model's weights come from (None: untouched)."""
        return None if self._last_weights is None else self._last_weights[0]

    def _shutdown(self) -> None:
        if self._coordinator is not None:
            self._coordinator.close()
        if self._backend is not None:
            self._backend.stop()
            cleanup = getattr(self._backend, "cleanup", None)
            if cleanup:
                cleanup()

    def _name(self, rank: int) -> str:
        return self._handles[rank].describe() if rank < len(self._handles) else f"worker {rank}"

    def _notify(self, kind: str, payload: Any = None) -> None:
        for listener in self.listeners:
            try:
                listener(kind, self.state, payload)
            except Exception:  # a broken renderer must not break training
                log.exception("progress listener failed")


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """On the main thread, turn SIGINT into a log line for the duration (Python raises
    KeyboardInterrupt only there, and only its handler can be swapped)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is None:
        yield
        return
    pressed: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if not pressed:
            log.warning("still stopping the workers; they will be gone in a few seconds")
        pressed.append(signum)

    previous = signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def job_arrays(spec: ModelSpec, shard: Dataset | None, validation: Dataset | None = None,
               with_optimizer: bool = False) -> list[np.ndarray]:
    """A job message's arrays, in the order a worker unpacks them (worker/runtime.py unpack_job):
    weights, optimizer state, custom objects, the shard's x and y, the validation x and y."""
    arrays: list[np.ndarray] = list(spec.weights)
    if with_optimizer and spec.optimizer_weights is not None:
        arrays += spec.optimizer_weights
    if spec.custom_objects:
        arrays.append(np.frombuffer(spec.custom_objects, dtype=np.uint8))
    for part in (shard, validation):
        if part is not None:
            arrays.append(part.x)
            if part.y is not None:
                arrays.append(part.y)
    return arrays


__all__ = ["TrainingJob", "NbdistError", "TrainingFailed"]
