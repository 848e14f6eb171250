"""An elastic run as a worker runs it (docs/elastic.md): train a generation, commit, roll back, train the next.

Contract: ``run_elastic`` trains the job's generation under allreduce. At the start of every epoch (so after
the previous epoch's metrics, validation and the driver's decision) the worker copies the model's whole state
into its own memory: the commit. When the generation's collective breaks (a peer died: shared memory's
``PeerGone``, Gloo's closed connection; or anything else raised), it closes that collective, reports ``Lost``
(the epochs its commit holds, the steps it had run past it, the error) and waits for the driver, which alone
decides membership: either the next generation's job (a new rank, world and shard, the same model spec),
trained from a model made anew from that spec with the commit put back into it; or a stop, which ends the
process. Under allreduce every worker holds the same state at a commit, so a survivor needs nobody's copy.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from ..strategies.averaging import synced_state
from ..wire.messages import JobMessage
from ..wire.reports import Lost

log = logging.getLogger("nbdist.worker")


class Commit:
    """The model's state in this worker's memory: every variable of the model and of its optimizer (weights,
    slots, step count, learning rate, seed generators) and a torch model's float buffers, after ``epochs``."""

    def __init__(self) -> None:
        self.epochs: int | None = None
        self.values: list[np.ndarray] = []
        self.steps = 0  # the optimizer's step count at the commit

    def take(self, model: Any, epochs: int) -> None:
        synced_state(model)  # JAX: the running fit's state into the variables first
        self.values = [np.array(v.numpy(), copy=True) for v in state_variables(model)]
        self.epochs = epochs
        self.steps = optimizer_steps(model)

    def steps_past(self, model: Any) -> int:
        """Steps ``model`` has applied since the commit: what a rollback loses (a step that broke applied none).
        0 where a broken fit left its state unreadable (JAX's donated buffers)."""
        try:
            synced_state(model)
            return max(0, optimizer_steps(model) - self.steps)
        except Exception as exc:
            log.info("the steps past the commit cannot be read from the broken fit: %s", exc)
            return 0

    def put(self, model: Any) -> None:
        """Into ``model`` (made from the same spec: the same variables in the same order), all of it."""
        variables = state_variables(model)
        if len(variables) != len(self.values):
            raise RuntimeError(f"the commit holds {len(self.values)} variables and the model {len(variables)}")
        for v, value in zip(variables, self.values):
            v.assign(value)


def optimizer_steps(model: Any) -> int:
    optimizer = getattr(model, "optimizer", None)
    return 0 if optimizer is None else int(np.asarray(keras.ops.convert_to_numpy(optimizer.iterations)))


def state_variables(model: Any) -> list[Any]:
    """What a commit holds, in a fixed order (duplicates once)."""
    from ..model.tensors import float_buffers

    seen: set[int] = set()
    out: list[Any] = []
    optimizer = getattr(model, "optimizer", None)
    for v in [*model.variables, *(optimizer.variables if optimizer is not None else [])]:
        if id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return out + float_buffers(model)


class CommitCallback(keras.callbacks.Callback):
    """Commits at every epoch's start."""

    def __init__(self, commit: Commit) -> None:
        super().__init__()
        self.commit = commit

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.commit.take(self.model, epoch)


def run_elastic(link: Any, job: JobMessage, model: Any, lr_factor: float,
                connect: Callable[[Any, JobMessage], Any], make_model: Callable[[JobMessage], Any],
                fit: Callable[..., None]) -> None:
    """Train generation after generation until one finishes (module docstring).

    ``connect(link, job)`` opens a generation's collective, ``make_model(job)`` makes the model anew from the
    job's spec, ``fit(link, job, model, collective, lr_factor, extra_callbacks)`` trains it (allreduce_fit.py)."""
    commit = Commit()
    while True:
        collective = None
        try:
            collective = connect(link, job)
            fit(link, job, model, collective, lr_factor, [CommitCallback(commit)])
            return
        except Exception as exc:
            error = link.error_report(exc)
        finally:
            if collective is not None:
                collective.close()
        generation = int(job.train.generation)
        if commit.epochs is None:  # broke before its first epoch began: the job as it came is the commit
            commit.take(model, int(job.train.initial_epoch))
        lost = commit.steps_past(model)
        log.warning("worker %d: generation %d broke (%s); holding the commit after %d epochs, %d steps past it",
                    job.rank, generation, error.message, commit.epochs, lost)
        link.send(Lost(generation, int(commit.epochs), lost, error.exception, error.message,
                       error.traceback, error.raised_type, error.raised_message))
        job = next_generation(link, job, generation)
        if int(job.train.initial_epoch) != commit.epochs:  # the driver's point is every survivor's commit
            raise RuntimeError(f"generation {job.train.generation} starts after {job.train.initial_epoch} epochs, "
                               f"but worker {job.rank}'s commit holds {commit.epochs}")
        model = make_model(job)
        commit.put(model)


def next_generation(link: Any, job: JobMessage, generation: int) -> JobMessage:
    """The driver's job for a later generation (a stop ends this process on the link's reader thread)."""
    from .runtime import unpack_job

    timeout = float(job.train.sync_timeout) + float(job.train.startup_timeout)
    while True:
        nxt = link.expect(JobMessage, timeout=timeout)
        if nxt.train is not None and int(nxt.train.generation) > generation:
            nxt.threads = job.threads  # TensorFlow's thread pools are fixed once made: the budget stays
            return unpack_job(nxt)
        log.warning("ignoring a job of generation %s after generation %d", getattr(nxt.train, "generation", None),
                    generation)
