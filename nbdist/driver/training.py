"""A training run as the driver sees it: the model and its shards out, metrics and weights back.

``TrainingJob`` is a ``Run`` (driver/run.py: launch, pump, health, stop, shutdown) that adds
what only training has: validation data, averaging rounds, the Gloo rendezvous relayed from
rank 0 to the others, per-epoch merged metrics, the synchronised weights written back into
the notebook's model, checkpoints and restarts (driver/keeper.py), and for an intercepted
``model.fit`` (driver/fit_call.py) its global batches dealt over the workers and the notebook's
callbacks run here on merged logs.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..checks import non_finite, non_finite_message
from ..config import TrainConfig
from ..data.inputs import FitData, PyDatasetData
from ..data.sharding import batches_per_epoch, rank_batch_sizes, shard_bounds, share_count
from ..data.structures import map_struct
from ..errors import NbdistError, TrainingFailed
from ..machine.placement import meeting, threads_per_worker
from ..model.seeding import run_seed
from ..model.spec import ModelSpec, apply_state, spec_from_model
from ..spark.data import SparkData
from ..strategies.averaging import rounds_per_epoch
from ..strategies.host_collective import remove_meeting_place
from ..wire.commands import GenerationBroken, JoinAtCommit, Rendezvous, Stop
from ..wire.messages import BatchSummaries, JobMessage, Placement, TrainSettings
from ..wire.reports import AsyncPull, AsyncPush, AtCommit, Epoch, Lost, Store, Weights
from .async_server import plan_arrays, start_async
from .failures import describe_exit, last_traceback
from .keeper import CheckpointKeeper
from .membership import Membership
from .resolve import resolve_backend
from .run import Run, data_parts
from .state import TERMINAL, MembershipChange, RunState, WorkerProgress

log = logging.getLogger(__name__)

# How long a worker whose connection closed may take to be known gone (a lost Spark executor: Spark's news).
GONE_WAIT = 10.0
# How long a stop waits for rank 0's last weights when they are not sent every epoch.
STOP_WEIGHTS_WAIT = 10.0
# How long a worker's Lost waits for the peer whose death broke its collective to be seen ended.
LOST_PEER_WAIT = 5.0
# Where an elastic run (workers MIN:MAX) runs (docs/elastic.md): backends that see a worker's end; Spark: classic
# sessions only. Those with ``add_worker`` (local, containers) also start a replacement for a lost worker.
ELASTIC_BACKENDS = ("local", "containers", "spark")


class TrainingJob(Run):
    """One run of ``nbdist.train``: ``.status``, ``.history``, ``.wait()``, ``.stop()``."""

    spark_data_needs_spark = ("a Spark DataFrame or RDD trains on the Spark backend; use --backend spark "
                              "(or auto with the SparkContext active), or convert it to numpy first.")
    data_name = "training data"

    def __init__(self, model: Any, config: TrainConfig, train: FitData | PyDatasetData | SparkData,
                 validation: FitData | PyDatasetData | None = None, namespace: dict[str, Any] | None = None,
                 listeners: list[Callable[[str, RunState, Any], None]] | None = None) -> None:
        super().__init__(model, config, train, namespace, listeners)
        # Drawn now, at the fit: the notebook's seeded generators give the same seed every run (model/seeding.py).
        # A relaunch after a failure keeps it.
        self.run_seed = run_seed(config.seed)
        self.validation_data = validation
        self._val_shards: list[tuple[int, int]] | None = None
        self._rounds = 0  # averaging rounds per epoch, the same on every worker
        self._keeper: CheckpointKeeper | None = None  # --checkpoint-dir / --resume / --max-restarts
        self._batch_summaries: BatchSummaries | None = None  # the notebook's TensorBoard's part on worker 0
        self._initial_epoch = 0
        self._restart_pending: tuple[int, str, str] | None = None  # (rank, message, traceback) of the cause
        self._rendezvous: Rendezvous | None = None  # where rank 0's store listens, once it says
        # (epoch, weights, number of optimizer arrays) from rank 0's last synchronisation
        self._last_weights: tuple[int, list[np.ndarray], int] | None = None
        self._applied_epoch: int | None = None  # the epoch whose state went into the model during the run
        self._opt_weights: list[np.ndarray] = []
        self._buffers: list[np.ndarray] = []  # rank 0's torch module buffers with those weights
        self._iterations: int | None = None
        self._layout: list[list[int]] = []  # each optimizer's variables among the weights (model_io)
        # An intercepted model.fit (or nbdist.train with fit's arguments): its data plan and the
        # notebook's callbacks, run here with merged logs (fit_call.py, callbacks.py).
        self.fit: Any = None
        self._first_lr: float | None = None  # the first epoch's rate, as the notebook's callbacks chose it
        self._rank_batches: list[int] = []  # each rank's batch size (its share of fit's global batch)
        self._rows: list[np.ndarray] = []  # an intercepted fit: the rows dealt to each rank
        self._epoch_steps: int | None = None  # fit's steps_per_epoch as every worker runs it (fit_call.py)
        self._data_epoch = 0  # the epoch at which the fit's data iterator started (BackupAndRestore moves it)
        self._py_datasets: bytes | None = None  # a fit on PyDatasets: what every worker gets (_prepare)
        self._weights_every_epoch = True  # decided per launch (_wants_weights_every_epoch)
        self._async: Any = None  # --strategy async: the shared model (async_server.py)
        self._said_non_finite = False  # a metric became NaN or infinite: said once per run
        self._directions: dict[str, str] = {}  # the compiled metrics' directions, as the workers' models hold them
        # An elastic run (workers="MIN:MAX"): who trains, by generation (membership.py); the global batch of a
        # plain run's launch, dealt again over the survivors.
        self._membership: Membership | None = None
        self._global_batch = 0
        self._below_min = ""  # why an elastic run's failure did not go on (said with it)
        self._started: set[int] = set()  # an elastic run's workers that said hello before its first generation
        self._resume_step = 0  # an elastic run's generation resumes epoch _initial_epoch after this many steps
        self._not_started: dict[int, str] = {}  # and those that will not be in it, with why

    def __repr__(self) -> str:
        if self.state is None:
            return f"<TrainingJob {self.status}>"
        st = self.state
        return (f"<TrainingJob {st.status}: {st.initial_epoch + st.epochs_done}/{st.epochs} epochs on "
                f"{st.world_size} {st.backend} workers>")

    @property
    def fit_history(self) -> Any:
        """The ``keras.callbacks.History`` of an intercepted ``model.fit`` (None for a plain run)."""
        return self.fit.callbacks.history if self.fit is not None else None

    @property
    def weights_epoch(self) -> int | None:
        """The epoch whose end the model's weights come from (None: untouched)."""
        return None if self._last_weights is None else self._last_weights[0]

    # -- Run's hooks ----------------------------------------------------
    def _make_spec(self) -> ModelSpec:
        return spec_from_model(self.model, self.config.strategy)

    def _world_limits(self) -> dict[str, int]:
        """A fit's world: no more workers than rows in its global batch (each step is split into one part per
        worker) and in its data (each worker its rows), or than a PyDataset's batches (each worker whole ones)."""
        if isinstance(self.data, PyDatasetData):  # under steps_per_epoch, an epoch's batches
            steps = self.fit.py_dataset_steps(self.data.batches) if self.fit is not None else None
            return {"batches": steps or self.data.batches}
        limits = super()._world_limits()
        if self.fit is not None and self.fit.global_batch is not None and isinstance(self.data, FitData):
            limits["batch"] = self.fit.global_batch
        return limits

    @property
    def _fit_deals_rows(self) -> bool:
        """Whether the fit's batch plan deals this run's rows (in-memory data, a PyDataset); Spark's rows stay
        with their tasks, as in a run without a fit (a DataFrame run's FitRun holds only its callbacks)."""
        return self.fit is not None and not isinstance(self.data, SparkData)

    def _plan_shards(self, backend: Any, world: int) -> list[tuple[int, int]] | None:
        self._rank_batches = [self.config.batch_size] * world
        if not self._fit_deals_rows:
            return super()._plan_shards(backend, world)
        if isinstance(self.data, PyDatasetData):
            return self._plan_py_dataset(world)
        if self.config.strategy == "async":  # every worker holds the arrays; the driver deals their batches
            self._initial_epoch = self.fit.initial_epoch
            unit, shares = plan_arrays(self.fit, len(self.data), world, self.config.batch_size)
            self._rank_batches = [unit] * world
            return shares
        # Every global batch dealt over the workers (data.deal_rows).
        self._rank_batches, self._rows = self.fit.plan(world, self.config.batch_size)
        self._initial_epoch = self.fit.initial_epoch
        self._epoch_steps = self.fit.worker_steps(world, self.config.batch_size)
        if self._epoch_steps is not None:  # an epoch of steps_per_epoch full batches, not a pass
            return [(0, self._epoch_steps * b) for b in self._rank_batches]
        return [(0, len(rows)) for rows in self._rows]

    def _plan_py_dataset(self, world: int) -> list[tuple[int, int]]:
        """Every worker reads whole batches of the PyDataset, strided (data.share_indices), an epoch's part of a
        pass under fit's ``steps_per_epoch``. Its rows per batch are only known as they are read: batch 0's count
        stands in for progress until then."""
        data: PyDatasetData = self.data
        self._initial_epoch = self.fit.initial_epoch
        self._rank_batches = [data.first_rows] * world
        self._epoch_steps = self.fit.py_dataset_steps(data.batches)
        if self._epoch_steps is not None and self.config.strategy == "async":
            raise NbdistError(f"--strategy async deals whole passes over the PyDataset's batches, but "
                              f"steps_per_epoch={self.fit.steps_per_epoch} makes an epoch part of one; drop "
                              "steps_per_epoch, or use --strategy allreduce.")
        per_epoch = self._epoch_steps or data.batches
        return [(0, share_count(per_epoch, r, world) * data.first_rows) for r in range(world)]

    def _batch_sizes(self) -> list[int]:
        return self._rank_batches

    def _shard(self, rank: int) -> FitData | PyDatasetData | None:
        if isinstance(self.data, PyDatasetData):
            return self.data  # the worker reads its own share of it
        if self._fit_deals_rows:
            rows = slice(None) if self.config.strategy == "async" else self._rows[rank]  # async: all of them
            if self._x_file() is not None:  # the worker reads its features from the file (_file_rows)
                pick = lambda a: a[rows]
                return FitData(None, map_struct(pick, self.data.y), map_struct(pick, self.data.sample_weight))
            files = self._x_leaves()
            if files:  # memory-mapped inputs of several: read from their files, never taken here
                return self.data.without_x_leaves(files).take(rows)
            return self.data.take(rows)
        return super()._shard(rank)

    def _x_file(self) -> Any:
        """As for every run, but never with sample weights (or class weights, which become them): a worker
        streams a file's features with their labels only, so weighted rows cross the wire with their weights."""
        if isinstance(self.data, FitData) and self.data.sample_weight is not None:
            return None
        return super()._x_file()

    def _file_rows(self, rank: int) -> dict[str, Any] | None:
        if not self._fit_deals_rows:
            return None
        deal = (sum(self._rank_batches), self.world_size, rank)
        where = (lambda f: f.rows(0, len(self.data))) if self.config.strategy == "async" else (lambda f: f.dealt(*deal))
        source = self._x_file()
        if source is not None:
            return where(source)
        files = self._x_leaves()
        return {"leaves": {str(i): where(f) for i, f in files.items()}} if files else None

    def _check_collectives(self, backend: Any, world: int) -> None:
        from ..machine.placement import collectives_missing

        if backend.name != "local":  # Spark's executors and containers may have what this Python lacks
            return
        problem = collectives_missing(world, self.config.strategy, self.config.engine)
        if problem is not None:
            raise NbdistError(problem)

    def _new_state(self, backend: Any) -> RunState:
        return RunState(self.world_size, self.config.epochs, backend=backend.name, strategy=self.config.strategy,
                        initial_epoch=self._initial_epoch, min_workers=self.config.min_workers)

    def _prepare(self) -> None:
        cfg, world = self.config, self.world_size
        if cfg.elastic:
            self._membership = self._elastic_membership(world)
        if cfg.strategy == "async":
            self._async = start_async(self, cfg, world)
        if self.fit is not None and isinstance(self.validation_data, FitData):  # validation_steps: its first rows
            per_worker = None if isinstance(self.data, PyDatasetData) else cfg.batch_size
            keep = self.fit.validation_rows(len(self.validation_data), world, per_worker)
            if keep < len(self.validation_data):
                self.validation_data = self.validation_data.slice(0, keep)
        steps = self.fit.validation_steps if self.fit is not None else None
        if isinstance(self.validation_data, PyDatasetData) and steps and steps < self.validation_data.batches:
            self.validation_data = dataclasses.replace(self.validation_data, batches=int(steps))  # its first batches
        self._val_shards = (shard_bounds(len(self.validation_data), world)
                            if isinstance(self.validation_data, FitData) else None)
        if isinstance(self.data, PyDatasetData) or isinstance(self.validation_data, PyDatasetData):
            self._py_datasets = self._pack_py_datasets()
        # Last of the checks (a temporary checkpoint directory is made here and removed by every ending).
        self._keeper = CheckpointKeeper.for_run(cfg, self.model)
        if self._keeper is not None:
            self._spec, self._initial_epoch = self._keeper.start_point(self._spec)
        # A new fit call reads its data from the start (a relaunch after a failure continues it).
        self._data_epoch = self._initial_epoch

    def _elastic_membership(self, world: int) -> Membership:
        """The first generation of an elastic run, checked at the door (docs/elastic.md)."""
        cfg = self.config
        backend = resolve_backend(cfg)
        connect = bool(getattr(backend, "connect", False))
        if backend.name not in ELASTIC_BACKENDS or connect:
            where = "Spark Connect" if connect else f"--backend {backend.name}"
            raise NbdistError(f"workers MIN:MAX (elastic) runs on the local and containers backends and classic Spark "
                              f"sessions so far, not {where}; give --workers a single number there.")
        if world < cfg.min_workers:
            raise NbdistError(f"--workers {cfg.min_workers}:{cfg.workers} needs at least {cfg.min_workers} workers, "
                              f"but this run's data allows only {world}; lower MIN to {world}.")
        if cfg.commit_every is not None and (isinstance(self.data, PyDatasetData) or self._x_file() is not None or (
                self.fit is not None and self.fit.steps_per_epoch)):  # a worker resumes an epoch at a step of its rows
            raise NbdistError("commit_every needs the training data as in-memory arrays, one pass per epoch (not a "
                              "PyDataset, a memory-mapped .npy or fit's steps_per_epoch); drop commit_every.")
        self._global_batch = sum(self._rank_batches)
        if self.fit is not None and self.fit.global_batch is None:  # --batch-size per worker: at launch's world
            self.fit.global_batch = self._global_batch  # the batch later generations deal (_deal_again)
        return Membership(cfg.min_workers, world)

    def _pack_py_datasets(self) -> bytes:
        import cloudpickle

        # Every worker shuffles the batch order with the same seed: their shares must stay disjoint.
        pick = lambda d: d if isinstance(d, PyDatasetData) else None
        return cloudpickle.dumps({"train": pick(self.data), "validation": pick(self.validation_data),
                                  "order_seed": int(self.run_seed)})

    def _shards_known(self, batches: list[int]) -> None:
        self._rounds = rounds_per_epoch(batches, self.config.averaging_frequency)

    def _seed_state(self, state: RunState) -> None:
        if self._keeper is not None:
            self._keeper.seed_state(state)
        if self.fit is not None:  # on_train_begin, on_epoch_begin: the first epoch's learning rate
            try:
                self.fit.callbacks.check(self.validation_data is not None or self._validation_on_tasks())
            except Exception:
                self._release()
                raise
            self._batch_summaries = self.fit.callbacks.batch_summaries(state.backend == "local")
            asked = self.fit.callbacks.initial_epoch
            self._first_lr = self.fit.callbacks.begin()
            start = self.fit.callbacks.initial_epoch
            if start != asked:  # BackupAndRestore restored its backup: the workers start there
                self._check_restored_start(start)
                self._initial_epoch = self._data_epoch = state.initial_epoch = start
                self._spec = self._make_spec()  # with the restored weights and optimizer state

    def _job_message(self, rank: int) -> JobMessage:
        cfg, backend = self.config, self._backend
        val = None
        if self._val_shards is not None:
            va, vb = self._val_shards[rank]
            val = self.validation_data.slice(va, vb)
        fit = self.fit
        self._weights_every_epoch = self._wants_weights_every_epoch()
        settings = TrainSettings.from_config(
            cfg, seed=self.run_seed, rounds_per_epoch=self._rounds, initial_epoch=self._initial_epoch,
            validation_anywhere=self.validation_data is not None or self._validation_on_tasks(),
            validation_on_tasks=self._validation_on_tasks(),
            batch_sizes=list(self._rank_batches) if self._fit_deals_rows or cfg.elastic else None,
            learning_rate=self._first_lr, elastic=cfg.elastic,
            generation=self._membership.generation if self._membership is not None else 0,
            resume_step=self._resume_step,
            epoch_decisions=bool(fit is not None and fit.callbacks.needs_decisions),
            swap_ema=bool(fit is not None and fit.callbacks.swaps_ema),
            raise_on_nan=bool(fit is not None and fit.callbacks.raises_on_nan),
            batch_summaries=self._batch_summaries,
            validation_freq=fit.validation_freq if fit is not None else 1,
            weights_every_epoch=self._weights_every_epoch, **self._data_start())
        placement = Placement(backend.bind_host, backend.advertise_host, backend.gloo_ifname, backend.store_on_link,
                              meet=meeting(backend.name, self.world_size, self.config.strategy))
        x_val, y_val, w_val = data_parts(val)
        return self._common_job(rank, "train", train=settings, placement=placement,
                                x_val=x_val, y_val=y_val, sample_weight_val=w_val, py_datasets=self._py_datasets)

    def _validation_on_tasks(self) -> bool:
        """A validation DataFrame: the Spark tasks write each worker's share of it (spark/backend.py)."""
        return isinstance(self.data, SparkData) and self.data.validation is not None

    def _check_restored_start(self, start: int) -> None:
        if start >= self.config.epochs:
            self.fit.callbacks.end()  # as Keras: no epoch left, on_train_end (which removes the backup)
            self._release()
            raise NbdistError(f"BackupAndRestore restored epoch {start} of epochs={self.config.epochs}: nothing "
                              "is left to train; raise epochs to train on.")

    def _data_start(self) -> dict[str, Any]:
        """steps_per_epoch: where the workers' data starts, as the uninterrupted fit would read it there."""
        if self._epoch_steps is None:
            return {}
        batches = self.data.batches if isinstance(self.data, PyDatasetData) else \
            -(-len(self.data) // sum(self._rank_batches))
        first_pass, first_batch = self.fit.data_start(self._initial_epoch, self._data_epoch, self._epoch_steps,
                                                      batches)
        return {"steps_per_epoch": self._epoch_steps, "first_pass": first_pass, "first_batch": first_batch}

    def _wants_weights_every_epoch(self) -> bool:
        """Who reads the weights at an epoch's end: a checkpoint (--checkpoint-dir, restarts) or a notebook
        callback that may read or save the model. Otherwise they travel once, at the end or on a stop
        (15-30 ms of rank 0's epoch saved on a loaded machine for the digits MLP)."""
        return self._keeper is not None or (self.fit is not None and self.fit.callbacks.needs_model)

    def _before_stop(self) -> None:
        """Weights not sent every epoch: ask rank 0 for its last epoch's before every worker goes."""
        if self._weights_every_epoch or self._coordinator is None or self._async is not None:
            return  # async: the driver holds the shared weights
        first = self._slots()[0]  # rank 0 (an elastic run's may have another launch rank)
        try:
            self._coordinator.send(first, Stop(weights=True))
        except (ConnectionError, OSError):
            return  # rank 0 is not (or no more) connected: the model keeps what it has
        deadline = time.monotonic() + STOP_WEIGHTS_WAIT
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self._coordinator.events.get(timeout=left)
            except queue.Empty:
                log.warning("rank 0 sent no weights within %.0f s of the stop", STOP_WEIGHTS_WAIT)
                break
            if event.rank != first:
                continue  # stopping: the other workers' news no longer matters
            if event.kind == "closed":
                break  # rank 0 had no finished epoch to send
            if event.kind == "message" and isinstance(event.message, Weights):
                self._on_message(first, event.message)
                break

    def _send_job(self, rank: int) -> None:
        m = self._membership
        if m is not None and not m.formed:  # an elastic run's first generation is those that start in time
            self._started.add(rank)
            return
        if m is not None and rank not in m.members and m.hello(rank):  # a joiner: it joins at the next change
            log.info("%s is ready to join; it joins at the next commit", self._name(rank))
            return
        if rank in self._left:  # left, or not wanted (no room): this run goes on without it
            try:
                self._coordinator.send(rank, Stop())
            except (ConnectionError, OSError):
                pass
            return
        super()._send_job(rank)
        if self._rendezvous is not None:  # rank 0 published the store before this worker came
            try:
                self._coordinator.send(rank, self._rendezvous)
            except (ConnectionError, OSError):
                pass  # gone already: its "closed" event goes to the health check

    def _on_message(self, rank: int, msg: Any) -> bool:
        if isinstance(msg, Epoch):
            self._directions = msg.directions or self._directions
            merged = self.state.worker_epoch(rank, msg)
            if merged is not None:
                self._epoch_merged(msg.epoch, merged)
        elif isinstance(msg, Lost):
            self._on_lost(rank, msg)
        elif isinstance(msg, AtCommit):
            if self._membership is not None:
                self._membership.report(rank, msg)
        elif isinstance(msg, Weights):
            self._last_weights = (msg.epoch, msg.weights, len(msg.optimizer))
            self._opt_weights = msg.optimizer
            self._buffers = msg.buffers
            self._iterations = msg.iterations
            self._layout = msg.layout
        elif isinstance(msg, (AsyncPull, AsyncPush)) and self._async is not None:
            self._async_message(rank, msg)
        elif isinstance(msg, Store):
            # Kept for workers that connect later (a warm rank 0 can be seconds ahead of a cold
            # rank 1); one that connected but has no job yet drops this copy and gets it with its job.
            self._rendezvous = Rendezvous(msg.host, msg.port, msg.path)
            self._coordinator.broadcast(self._rendezvous)
        else:
            return False
        return True

    def _epoch_merged(self, epoch: int, merged: dict[str, Any]) -> None:
        """Every worker's logs of ``epoch`` are in: checkpoint, listeners, the notebook's callbacks."""
        self._save_checkpoint(epoch)
        if self.status in TERMINAL:  # the checkpoint could not be written
            return
        self._notify("epoch", merged)
        bad = non_finite(merged)
        if bad is not None and not self._said_non_finite:  # Keras trains on: so do the workers
            self._said_non_finite = True
            log.warning("%s", non_finite_message(bad, merged[bad], epoch))
        if self.fit is not None:
            if bad == "loss" and self.fit.callbacks.terminates_on_nan:
                # TerminateOnNaN: stop after this epoch, its History kept (Keras stops mid-epoch)
                self.model.stop_training = True
            self._fit_epoch_end(epoch, merged)

    def _async_message(self, rank: int, msg: AsyncPull | AsyncPush) -> None:
        server = self._async
        try:
            if isinstance(msg, AsyncPull):
                server.pull(rank, msg)
            else:
                server.push(rank, msg)
        except (ValueError, ConnectionError, OSError) as exc:
            self._fail(rank, f"{self._name(rank)}: {exc}", "")
            return
        done = server.completed_epoch
        if done is not None and (self._last_weights is None or self._last_weights[0] != done):
            # The shared weights at the end of an epoch: what a stop or the end leaves in the model.
            self._last_weights, self._opt_weights, self._iterations, self._layout = \
                (done, server.full_weights(), 0), [], None, []

    def _holding(self) -> bool:
        return self._restart_pending is not None

    def _after_pump(self) -> None:
        if self._restart_pending is not None:
            self._restart()
        elif self._membership is not None and not self._membership.formed and self.status not in TERMINAL:
            self._form_when_started()
        elif self._membership is not None and self.status not in TERMINAL:
            self._elastic_tick()

    def _after_failure(self, message: str) -> str:
        if self._below_min and message:
            message = f"{message.rstrip().rstrip('.')} ({self._below_min})"
        # A failed run keeps nothing of what the workers trained (a stop keeps the last epoch's), unless the
        # notebook's callbacks read the model: then it holds the epoch they last saw, as after a local fit's error.
        if self._applied_epoch is not None:
            return (f"{message.rstrip().rstrip('.')}; the notebook's model holds the weights of epoch "
                    f"{self._applied_epoch + 1}, the last its callbacks saw.")
        return f"{message.rstrip().rstrip('.')}; the notebook's model was left as it was before the run."

    def _intercept_failure(self, rank: int | None, message: str, worker_traceback: str) -> bool:
        if self._restart_pending is not None:  # the first cause is the one a restart reports
            return True
        if rank is not None and self._membership is not None and not self._membership.formed:
            if self._not_starting(rank, message):
                return True
        elif rank is not None and self._membership is not None and self._process_gone(rank):
            if self._member_left(rank):
                return True
            m = self._membership  # too few left: as any run, the sentence saying why it did not go on
            self._below_min = (f"{len(m.survivors)} worker{'' if len(m.survivors) == 1 else 's'} left, fewer than "
                               f"the {m.minimum} that --workers {self.config.min_workers}:{self.config.workers} needs")
        if rank is not None and self._keeper is not None and self._keeper.can_restart():
            self._restart_pending = (rank, message, worker_traceback)  # pump() restarts, after this event
            return True
        return False

    def _keep_results(self) -> None:
        self._apply_last_weights()

    def _on_done(self) -> None:
        if self.fit is not None:
            self.fit.callbacks.end()  # e.g. EarlyStopping restores its best weights into the model

    def _fit_epoch_end(self, epoch: int, merged: dict[str, float]) -> None:
        """The notebook's callbacks see the shared weights and merged logs; their decision goes to every worker.
        The weights go into the model only for callbacks that read it: otherwise it stays as it was until the
        run ends, so a failed run (--data X,y with --checkpoint-dir, say) leaves it untouched."""
        if self.fit.callbacks.needs_model:
            self._apply_last_weights()
            if self._last_weights is not None:
                self._applied_epoch = self._last_weights[0]
        try:
            decision = self.fit.callbacks.epoch_end(epoch, merged, self._directions)
        except Exception as exc:  # the notebook's own callback raised: the fit raises it, as Keras' would
            self._fail(None, f"callback failed at the end of epoch {epoch + 1}: {type(exc).__name__}: {exc}", "",
                       exc)
            return
        if self.fit.callbacks.needs_decisions:
            for r in self._slots():
                try:
                    self._coordinator.send(r, decision)
                except (ConnectionError, OSError):
                    pass  # that worker is gone: the health check names the cause

    def _release(self) -> None:
        if self._keeper is not None:
            self._keeper.close()
        self._remove_meeting_place()
        self._drop_data()

    def _drop_data(self) -> None:
        """A finished run (done, failed or stopped; never before a restart, which relaunches on the data)
        holds nothing of its data: the job left in the notebook keeps results and reports, and the arrays
        it trained on are freed once the notebook lets go of them."""
        self.data = self.validation_data = None
        self._rows, self._py_datasets, self._val_shards = [], None, None

    # -- checkpoints and restarts (logic in keeper.py / checkpoint.py) --
    def _save_checkpoint(self, epoch: int) -> None:
        if self._keeper is None:
            return
        if self._last_weights is None or self._last_weights[0] != epoch:
            log.warning("no synchronised weights for epoch %d; its checkpoint is skipped", epoch + 1)
            return
        try:
            self._keeper.save(epoch + 1, self._last_weights[1], self._opt_weights, self._iterations,
                              self.state.history, self.world_size, self._buffers)
        except OSError as exc:
            self._fail(None, f"could not write the checkpoint to {self._keeper.directory} ({exc}); free some "
                             "space or choose another --checkpoint-dir.", "")

    def _remove_meeting_place(self) -> None:
        """Rank 0 removes the workers' meeting directory when it closes; one that was killed leaves it here
        (a local run: this machine's /dev/shm)."""
        if self._rendezvous is not None and self._rendezvous.path:
            remove_meeting_place(self._rendezvous.path)

    def _restart(self) -> None:
        """Tear every worker down and relaunch them all from the last checkpoint."""
        rank, message, worker_traceback = self._restart_pending
        self._shutdown()  # waits for every worker process to end
        self._restart_pending = None
        keeper = self._keeper
        self._done, self._closing, self._silent = set(), {}, {}
        self._remove_meeting_place()
        self._rendezvous = None  # the new rank 0 publishes a new store
        try:
            backend = resolve_backend(self.config)
            fewer = self._fit_world(backend)  # e.g. an executor gone for good: the task slots left
            if self._membership is not None:  # the relaunch is a new first generation, of the world it had
                self._membership, self._left = Membership(self._membership.minimum, self.world_size), set()
                self._started, self._not_started, self._below_min, self._resume_step = set(), {}, "", 0
                if fewer:
                    self._deal_again(self.world_size)
            self._spec, self._initial_epoch = keeper.restart_point()
            self._rewind_last_weights()
            self.state.restarting(self._initial_epoch)
            reason = keeper.restart_reason(message, self._initial_epoch) + fewer
            log.info("%s", reason)
            self._notify("restart", reason)
            self._launch(backend)
        except Exception as exc:
            self._fail(rank, f"relaunching the workers failed ({exc}) after: {message}", worker_traceback)

    def _fit_world(self, backend: Any) -> str:
        """A relaunch asks for no more workers than the backend has room for now (Spark: its free task slots,
        ``free_slots``), rather than waiting for slots that are gone; the words saying so ('' when all fit).
        Each worker keeps its --batch-size (an elastic run: the launch's global batch, dealt by the caller)."""
        free = getattr(backend, "free_slots", None)
        room = None if free is None else free()  # None: no bound known (Spark under dynamic allocation)
        world = self.world_size if room is None else max(1, min(self.world_size, room))
        if world == self.world_size:
            return ""
        said = (f", with {world} worker{'' if world == 1 else 's'} instead of {self.world_size}: the "
                f"{backend.name} backend has room for {world} now")
        self.world_size = self.state.world_size = world
        self.state.workers = [WorkerProgress(rank=r) for r in range(world)]
        if self._membership is None:
            shards = self._plan_shards(backend, world)
            if shards is not None:  # Spark data: its tasks count their partitions again
                self._apply_shards(shards)
        if isinstance(self.validation_data, FitData):
            self._val_shards = shard_bounds(len(self.validation_data), world)
        return said

    def _rewind_last_weights(self) -> None:
        """What a stop before the relaunched workers finish an epoch leaves in the model: the
        checkpoint's state, not weights from an epoch that died with a worker."""
        if self._initial_epoch == 0:  # restarted from the model as given
            self._last_weights = None
            return
        opt = list(self._spec.optimizer_weights or [])
        self._last_weights = (self._initial_epoch - 1, list(self._spec.weights), len(opt))
        self._opt_weights, self._iterations = opt, self._keeper.iterations
        self._buffers = list(self._spec.buffers or [])

    def _apply_last_weights(self) -> None:
        if self._last_weights is None:
            return
        _, weights, n_opt = self._last_weights
        # All of the state or none of it (model_io.apply_state); the step count continues (Adam's bias
        # correction, LR schedules).
        apply_state(self.model, weights, self._opt_weights if n_opt and self._optimizer_shared() else None,
                    self._layout, self._iterations, self._buffers)

    def _optimizer_shared(self) -> bool:
        """Rank 0's optimizer state is every worker's: allreduce, or averaging that averages it."""
        return self.config.strategy == "allreduce" or bool(self.config.average_optimizer)

    # -- elastic runs: membership by generation (membership.py, docs/elastic.md) --
    def _slots(self) -> list[int]:
        """The workers of the current generation by their launch ranks, in rank order."""
        return list(self._membership.members) if self._membership is not None else list(range(self.world_size))

    def _process_gone(self, slot: int) -> bool:
        """Worker ``slot``'s process ended (killed, crashed, its Spark task lost), not one that raised (exit 1), or it
        sent nothing past ``heartbeat_timeout`` (its host cut off, or it hung: ``_silent``)."""
        if slot >= len(self._handles):
            return False
        if slot in self._silent:
            return True
        handle = self._handles[slot]
        code = handle.exit_status()
        if code is None and hasattr(handle, "settle"):  # its connection closed; Spark tells a lost task's end later
            code = handle.settle(GONE_WAIT)
        return bool(getattr(handle, "lost", False)) or (code is not None and code not in (0, 1))

    def _not_starting(self, slot: int, message: str) -> bool:
        """Before the first generation: worker ``slot`` ended or did not connect in time (the health check's
        ``message``). True while enough others may still start."""
        m = self._membership
        self._not_started[slot] = message.removeprefix(self._name(slot)).strip()
        self._left.add(slot)
        self._started.discard(slot)
        left = len(m.members) - len(self._not_started)
        if left >= m.minimum:
            return True
        self._below_min = (f"{left} worker{'' if left == 1 else 's'} started, fewer than the {m.minimum} that "
                           f"--workers {self.config.min_workers}:{self.config.workers} needs")
        return False

    def _form_when_started(self) -> None:
        """The first generation, once every worker has started or will not: those that did, dealt the launch's
        global batch; the others are said in one line."""
        m = self._membership
        for h in self._handles:  # those the backend could not place (Spark: no free task slot) will not start
            if getattr(h, "unplaced", "") and h.rank not in self._not_started:
                self._not_starting(h.rank, f"{self._name(h.rank)} {h.unplaced}")
        if set(m.members) - self._started - set(self._not_started):
            return  # some are still starting (the health check ends their wait at startup_timeout)
        members = sorted(self._started - set(self._not_started))
        if len(members) < len(m.members):
            change = m.first(members, "; ".join(dict.fromkeys(self._not_started.values())), self._initial_epoch)
            self.world_size = len(members)
            self._deal_again(self.world_size)
            self.state.regrouped(change)
            log.info("%s", change.line)
            self._notify("membership", change)
        m.formed = True
        for rank, slot in enumerate(m.members):
            try:
                self._coordinator.send(slot, self._job_message(rank))
            except (ConnectionError, OSError) as exc:  # it went: the health check names it
                log.warning("could not send the job to %s: %s", self._name(slot), exc)
        for slot in sorted(self._started & set(self._not_started)):  # counted out, then started (Spark: a job that
            self._send_job(slot)  # waited for a slot got one): it joins at the next commit

    def _member_left(self, slot: int) -> bool:
        """Member ``slot`` is gone: the generation is broken; True while enough workers are left to go on."""
        m = self._membership
        if slot not in m.members or slot in m.leaving:
            return slot in m.gone  # already counted
        handle = self._handles[slot]
        silent = self._silent.get(slot)
        why = (f"sent nothing for {silent:.0f} s: its host cut off, or it hung" if silent is not None
               else describe_exit(handle.exit_status() or 0, handle))
        if not m.leave(slot, why):
            return False
        self._left.add(slot)
        log.info("%s %s; the others roll back to their last commit", handle.describe(), m.leaving[slot])
        self._leave_generation(slot)
        # Epochs every survivor finished are complete without it (the summed metrics are everyone's).
        for epoch, merged in self.state.workers_left({slot}, len(m.survivors)):
            self._epoch_merged(epoch, merged)
        return True

    def _leave_generation(self, slot: int) -> None:
        """Member ``slot`` left: stop it where the backend can (a silent one may come back: it is fenced off), and
        tell the survivors, so that none waits in a collective for it (one cut off closes no connection)."""
        remove = getattr(self._backend, "remove_worker", None)
        if remove is not None and self._handles[slot].exit_status() is None:
            try:
                remove(slot)
            except Exception as exc:  # e.g. a Spark session stopped meanwhile: its tasks went with it
                log.warning("could not stop %s: %s", self._name(slot), exc)
        m = self._membership
        for survivor in m.survivors:
            try:
                self._coordinator.send(survivor, GenerationBroken(m.generation))
            except (ConnectionError, OSError):
                pass  # it went too: the health check names it

    def _on_lost(self, slot: int, msg: Lost) -> None:
        """A worker's collective broke. A member gone: wait for the others (``_regroup_when_ready``); none gone:
        the worker's own error, which ends the run as any worker's would. A worker that joined and broke before it
        received the state holds nothing to go on from: it leaves (and is stopped)."""
        m = self._membership
        if m is None:
            return
        if msg.committed < 0 and slot in m.members and slot not in m.leaving:
            self._joiner_without_state(slot)
            return
        if not m.broken:
            # A container's end reaches its engine's client a moment after its peers saw it: wait a little longer
            # than for a process before calling the report the worker's own error (which is rare: no delay else).
            dead = self._dead_peer(slot, wait=LOST_PEER_WAIT)
            if dead is None:
                self._handle_message(slot, msg.error())
                return
            tb = last_traceback(dead.log_tail(400))
            self._fail(dead.rank, f"{dead.describe()} {describe_exit(dead.exit_status(), dead)} during training",
                       tb)
            if self.status in TERMINAL or self._restart_pending is not None:
                return
        m.report(slot, msg)

    def _regroup_when_ready(self) -> None:
        m = self._membership
        survivors = m.survivors
        # A pause's members may train a whole epoch before they reach the commit: its wait counts from the first
        # that stopped there (the others are in step with it), and then from the last joiner's deadline.
        since = m.broken_at if m.broken else m.paused_at
        if since is not None and m.starting and not m.broken:
            since = max(since, max(m.starting.values()))
        if survivors and all(s in self._done for s in survivors):  # the generation had finished
            self._complete()
        elif m.ready():
            self._regroup()
        elif since is not None and time.monotonic() - since > self.config.sync_timeout:
            waiting = ", ".join(self._name(s) for s in survivors if s not in m.lost)
            if not m.broken:
                self._fail(None, f"{waiting} did not stop at the commit where workers join within "
                                 f"{self.config.sync_timeout:.0f} s of the others (sync_timeout)", "")
                return
            self._fail(None, f"after {', '.join(self._name(s) for s in m.leaving)} left, {waiting} did not give up "
                             f"the broken collective within {self.config.sync_timeout:.0f} s (sync_timeout)", "")

    def _regroup(self) -> None:
        """The next generation: the survivors, their epoch dealt again over them (the global batch kept),
        each sent its job; they roll back to their commit and train on from there."""
        m = self._membership
        change = m.regroup()
        for slot in change.joined:  # watched as members from now on
            self._left.discard(slot)
            self._closing.pop(slot, None)
        world = len(change.workers)
        self.world_size = world
        self._remove_meeting_place()
        self._rendezvous = None  # the new rank 0 makes a new meeting place
        self._done, self._closing = set(), {s: t for s, t in self._closing.items() if s in self._left}
        self._deal_again(world)
        self._initial_epoch, self._resume_step = change.committed, change.step
        self.state.regrouped(change)
        if change.left or change.joined:
            log.info("%s", change.line)  # the text UI's line (ui/text.py); job.state.membership holds it
            self._notify("membership", change)
        for rank, slot in enumerate(m.members):
            try:
                self._coordinator.send(slot, self._job_message(rank))
            except (ConnectionError, OSError) as exc:  # it went too: the health check names it
                log.warning("could not send generation %d's job to %s: %s", m.generation, self._name(slot), exc)
        for slot in change.left:  # once the survivors train again: so a replacement joins at a commit of theirs
            self._replace(slot)

    def _elastic_tick(self) -> None:
        """After each pump of a formed elastic run: joiners watched, a generation ending (broken, or paused for
        joiners) regrouped once ready, a training one asked to pause at its next commit when workers wait to join."""
        m = self._membership
        self._watch_joiners()
        if m.broken or m.pausing:
            self._regroup_when_ready()
        elif m.wants_pause():
            m.pause()
            waiting = ", ".join(self._name(s) for s in [*m.waiting, *m.starting])
            log.info("%s to join: the workers stop together at their next commit", waiting)
            for slot in m.members:
                try:
                    self._coordinator.send(slot, JoinAtCommit(m.generation))
                except (ConnectionError, OSError):
                    pass  # it went: the health check names it, and the others break instead

    def _watch_joiners(self) -> None:
        """A joiner whose process ended, or that did not connect within ``startup_timeout`` of its launch, is given
        up: said in one line, not fatal (the members go on). It is not replaced."""
        m = self._membership
        now = time.monotonic()
        for slot in [*m.starting, *m.waiting]:
            code = self._handles[slot].exit_status()
            if code is not None:
                why = describe_exit(code, self._handles[slot])
            elif slot in m.starting and now > m.starting[slot]:
                why = f"did not connect within {self.config.startup_timeout:.0f} s"
            else:
                continue
            m.drop_joiner(slot)
            change = MembershipChange(generation=m.generation, left=[slot], why=why, workers=list(m.members),
                                      committed=self._initial_epoch, steps_lost=0, started=False)
            self.state.noted(change)
            self.state.worker_finished(slot, "stopped")
            log.warning("%s", change.line)
            self._notify("membership", change)

    def _replace(self, slot: int) -> None:
        """Start a worker in lost member ``slot``'s place (its cores, its GPU), if the backend can and the bounds
        allow (``Membership.replace``); it joins at the members' next commit. A backend that cannot start it is
        said in the log, not fatal."""
        m, backend = self._membership, self._backend
        add = getattr(backend, "add_worker", None)
        new = len(self._handles)
        if add is None or not m.replace(slot, new, time.monotonic() + self.config.startup_timeout):
            return
        self._coordinator.world_size = new + 1  # its hello names a rank past the launch's
        try:
            handle = add(new, slot, self._coordinator.address, self._coordinator.secret)
        except Exception as exc:
            self._coordinator.world_size = new
            m.drop_joiner(new)
            log.warning("could not start a worker in worker %d's place (%s); going on with %d workers", slot, exc,
                        len(m.members))
            return
        self._handles.append(handle)
        self._left.add(new)  # watched as a joiner (_watch_joiners) until it joins
        if getattr(handle, "unplaced", ""):  # Spark: its job waits for a task slot, maybe until the run ends; the
            m.drop_joiner(new)  # members do not wait for it: it joins at their first commit after its hello
            m.never_started.add(new)
        self.state.joiner_added(new)
        log.info("starting %s in worker %d's place; it joins at the next commit", handle.describe(), slot)
        self._notify("worker", new)

    def _joiner_without_state(self, slot: int) -> None:
        """Member ``slot`` joined and broke before rank 0's commit reached it: it leaves, as a lost member does,
        and is stopped."""
        m = self._membership
        if not m.leave(slot, "broke before it received the state"):
            self._fail(slot, f"{self._name(slot)} broke before it received the state, and too few workers are "
                             "left to go on", "")
            return
        self._left.add(slot)
        for epoch, merged in self.state.workers_left({slot}, len(m.survivors)):
            self._epoch_merged(epoch, merged)
        try:
            self._coordinator.send(slot, Stop())
        except (ConnectionError, OSError):
            pass

    def _threads(self) -> int:
        """An elastic run's workers keep the launch's budget, a joiner too: it takes a lost worker's cores."""
        if self._membership is None:
            return super()._threads()
        return threads_per_worker(self._membership.most * (self.config.local_share if self._local else 1))

    def _deal_again(self, world: int) -> None:
        """Each survivor's rows and batch for ``world`` workers: a plain run's launch global batch split over
        them (data/sharding.py), an intercepted fit's global batches dealt again (fit_call.py)."""
        if not self._fit_deals_rows:
            self._rank_batches = rank_batch_sizes(self._global_batch, world)
            shards = shard_bounds(len(self.data), world)
        else:  # the global batch is the fit's (fixed at launch: _elastic_membership)
            shards = self._plan_shards(self._backend, world)
        self._shards = shards
        batches = [batches_per_epoch(b - a, size) for (a, b), size in zip(shards, self._rank_batches)]
        for slot, (a, b), n in zip(self._membership.members, shards, batches):
            self.state.workers[slot].samples, self.state.workers[slot].batches = b - a, n
        self._shards_known(batches)
        if isinstance(self.validation_data, FitData):
            self._val_shards = shard_bounds(len(self.validation_data), world)


__all__ = ["TrainingJob", "NbdistError", "TrainingFailed", "last_traceback"]
