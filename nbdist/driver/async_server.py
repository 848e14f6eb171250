"""The driver's side of ``--strategy async``: the shared model, served from the run's event loop.

Workers send ``ASYNC_PULL`` (at each epoch's start; the first also carries the model's weights as
every worker has them from the job) and ``ASYNC_PUSH`` (a block's delta). Each is answered with
``ASYNC_SHARED``: the shared weights, their version, and the next block of the epoch's batches, or
``epoch_done`` once every batch of the epoch was trained and reported (then every worker gets the same
weights). A worker that finds the epoch's batches all dealt waits for that answer: at most one block
of the slowest worker. The rule (strategies/async_sgd.py) is applied here, one push at a time.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..data.sharding import epoch_order
from ..strategies.async_sgd import BatchPool, SharedModel, block_cap
from ..wire.commands import AsyncShared
from ..wire.reports import AsyncPull, AsyncPush

log = logging.getLogger(__name__)

Send = Callable[[int, AsyncShared], None]


class AsyncServer:
    def __init__(self, world_size: int, batches: int, k: int, shuffle: bool, seed: int, send: Send,
                 max_staleness: int | None = None) -> None:
        self.world_size, self.batches, self.k = world_size, batches, k
        self.shuffle, self.seed = shuffle, seed
        self.send = send
        self.max_staleness = max_staleness
        self.shared: SharedModel | None = None
        self.template: list[np.ndarray] = []  # every weight of the model; the exchanged ones at self.exchanged
        self.exchanged: list[int] = []
        self.epoch: int | None = None
        self.pool: BatchPool | None = None
        self.waiting: set[int] = set()
        self.completed_epoch: int | None = None  # the last epoch every batch of which was applied
        self.rates: dict[int, float] = {}  # each worker's batches per second, block to block (a running mean)
        self._dealt: dict[int, tuple[float, int]] = {}  # rank -> (when, batches) of its block out

    def pull(self, rank: int, pull: AsyncPull) -> None:
        epoch, arrays = pull.epoch, pull.weights
        if self.shared is None:
            if not pull.first:
                raise ValueError(f"worker {rank} pulled before any worker sent the model's weights")
            self.template = [np.array(a, copy=True) for a in arrays]
            self.exchanged = [i for i, a in enumerate(arrays) if a.dtype.kind == "f"]
            self.shared = SharedModel([arrays[i] for i in self.exchanged], self.world_size, self.max_staleness)
        if self.completed_epoch is not None and epoch <= self.completed_epoch:
            # The others trained all of that epoch before this worker came: it ends it on the shared weights.
            self._answer(rank, [], True, "")
            return
        if self.epoch != epoch:
            if self.pool is not None and not self.pool.complete:
                raise ValueError(f"worker {rank} started epoch {epoch + 1} before epoch {self.epoch + 1} ended")
            self.epoch = epoch
            self.pool = BatchPool(epoch_order(self.batches, self.shuffle, self.seed, epoch).tolist())
        self._next(rank)

    def push(self, rank: int, push: AsyncPush) -> None:
        assert self.shared is not None and self.pool is not None
        if push.epoch != self.epoch:
            raise ValueError(f"worker {rank} pushed for epoch {push.epoch} during epoch {self.epoch}")
        when, count = self._dealt.pop(rank, (0.0, 0))
        if count:
            rate = count / max(1e-6, time.monotonic() - when)
            self.rates[rank] = rate if rank not in self.rates else 0.5 * (self.rates[rank] + rate)
        verdict = self.shared.push(rank, push.seq, push.version, push.delta, push.samples)
        self.pool.report(rank)
        if not verdict.applied:
            log.warning("refused an update: %s", verdict.reason)
        self._next(rank, "" if verdict.applied else verdict.reason)

    def full_weights(self) -> list[np.ndarray]:
        """Every weight of the model, the exchanged ones as the shared model has them now."""
        assert self.shared is not None
        out = list(self.template)
        for i, w in zip(self.exchanged, self.shared.weights):
            out[i] = w.copy()
        return out

    def _next(self, rank: int, refused: str = "") -> None:
        assert self.pool is not None and self.shared is not None
        block = self.pool.deal(rank, min(self.k, block_cap(self.pool.left, rank, self.rates, self.world_size)))
        if block:
            self._dealt[rank] = (time.monotonic(), len(block))
            self._answer(rank, block, False, refused)
            return
        self.waiting.add(rank)
        if self.pool.complete:
            self.completed_epoch = self.epoch
            for r in sorted(self.waiting):
                self._answer(r, [], True, refused if r == rank else "")
            self.waiting.clear()

    def _answer(self, rank: int, block: list[int], done: bool, refused: str) -> None:
        assert self.shared is not None
        self.send(rank, AsyncShared(self.shared.version, block, done, refused, self.shared.weights))


def async_refusal(data: Any, validation: Any, fit: Any, checkpointing: bool) -> str:
    """Why this run cannot train with --strategy async (one sentence), or ""."""
    from ..data.inputs import FitData, PyDatasetData

    if fit is None or not isinstance(data, (PyDatasetData, FitData)):
        return ("--strategy async deals batches of in-memory arrays or of a keras.utils.PyDataset to whichever "
                "worker is free, and a Spark DataFrame or RDD stays on its executors; use --strategy averaging or "
                "allreduce for it, or convert it to numpy first.")
    if isinstance(validation, PyDatasetData):
        return ("--strategy async validates on arrays; pass validation_data=(x_val, y_val) as arrays, "
                "or use --strategy averaging.")
    if checkpointing:
        return ("--strategy async does not write checkpoints or restart yet; drop --checkpoint-dir, --resume and "
                "--max-restarts, or use --strategy averaging.")
    return ""


def plan_arrays(fit: Any, rows: int, world: int, per_worker_batch: int) -> tuple[int, list[tuple[int, int]]]:
    """Arrays under --strategy async: every worker holds them whole and trains batches of ``unit`` rows (its
    share of fit's global batch) as the driver deals them; returns ``unit`` and each worker's estimated rows
    (progress only: a fast worker takes more); the world fits the rows and the batch (driver/resolve.py).
    One sentence for what cannot be dealt."""
    from ..data.sharding import rank_batch_sizes, share_count
    from ..errors import NbdistError

    if fit.steps_per_epoch is not None and fit.worker_steps(world, per_worker_batch) is not None:
        raise NbdistError(f"--strategy async deals whole passes over the arrays, but steps_per_epoch="
                          f"{fit.steps_per_epoch} makes an epoch part of one; drop steps_per_epoch, or use "
                          "--strategy allreduce.")
    unit = rank_batch_sizes(fit.batch(world, per_worker_batch), world)[0]
    batches = -(-rows // unit)
    return unit, [(0, min(rows, share_count(batches, r, world) * unit)) for r in range(world)]


def start_async(job: Any, cfg: Any, world: int) -> AsyncServer:
    """The run's server, after the door's checks (one sentence on what does not fit)."""
    from ..data.inputs import PyDatasetData
    from ..errors import NbdistError

    refusal = async_refusal(job.data, job.validation_data, job.fit,
                            bool(cfg.checkpoint_dir or cfg.resume or cfg.max_restarts))
    if refusal:
        raise NbdistError(refusal)

    def send(rank: int, message: AsyncShared) -> None:
        job._coordinator.send(rank, message)

    # The batches of an epoch: a PyDataset's own; arrays cut into batches of one worker's rows (plan_arrays).
    batches = len(job.data) if isinstance(job.data, PyDatasetData) else -(-len(job.data) // job._batch_sizes()[0])
    return AsyncServer(world, batches, int(cfg.averaging_frequency), bool(cfg.shuffle), int(job.run_seed),
                       send, cfg.max_staleness)
