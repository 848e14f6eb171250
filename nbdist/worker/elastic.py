"""An elastic run as a worker runs it (docs/elastic.md): train a generation, commit, roll back, train the next.

``run_elastic`` trains the job's generation under allreduce, copying the model's whole state into memory at
every epoch's start (the commit). When the generation's collective breaks (a peer died, or anything raised) it
closes it, reports ``Lost`` (its commit's epochs, the steps run past it, the error) and waits for the driver,
which alone decides membership: the next generation's job (new rank, world and shard), trained from a model
made anew with the commit put back; or a stop. Asked by ``JoinAtCommit``, the members stop together at their
next commit after the one they started from (``JoinPoint.at_commit``, run after every commit) and report
``AtCommit``: nothing is rolled back. Every later generation starts with rank 0's commit broadcast over its new
collective (``share_commit``): a joiner takes it whole; the others hold the same already.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from ..strategies.averaging import synced_state
from ..wire.commands import JoinAtCommit
from ..wire.messages import JobMessage
from ..wire.reports import AtCommit, Lost

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
    """Commits at every epoch's start; ``after(epochs)`` then (the generation may end there: ``JoinPoint``)."""

    def __init__(self, commit: Commit, after: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.commit = commit
        self.after = after

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.commit.take(self.model, epoch)
        if self.after is not None:
            self.after(epoch)


class GenerationEnds(Exception):
    """Raised at a commit where every member stops for workers joining (``JoinPoint``)."""


class JoinRequests:
    """The newest generation the driver asked to end at its next commit (``JoinAtCommit``), set on the link's
    reader thread as the notice arrives, so no wait for another message drops it."""

    def __init__(self, link: Any) -> None:
        self.generation = -1
        link.handlers[JoinAtCommit] = self._asked

    def _asked(self, msg: JoinAtCommit) -> None:
        self.generation = max(self.generation, int(msg.generation))


class JoinPoint:
    """Where generation ``generation`` ends for workers waiting to join: ``at_commit``, after every commit but the
    one the generation started from. Whether the driver asked may reach the members at different moments, so they
    sum what each was told over their collective: all stop at the same commit, or none does."""

    def __init__(self, requests: JoinRequests, generation: int, collective: Any) -> None:
        self.requests, self.generation, self.collective = requests, generation, collective
        self.commits = 0

    def at_commit(self, epochs: int) -> None:
        self.commits += 1
        if self.commits == 1:  # the commit this generation started from
            return
        asked = np.array([1.0 if self.requests.generation >= self.generation else 0.0])
        self.collective.allreduce_sum(asked)
        if asked[0] > 0:
            raise GenerationEnds(f"generation {self.generation} ends at the commit after {epochs} epochs")


def share_commit(collective: Any, model: Any, commit: Commit, epochs: int, lr_factor: float) -> float:
    """Rank 0's commit, all of it, to every worker of a new generation, put into their models; returns rank 0's
    learning-rate factor (the launch's, which a joiner made for another world). A joiner's model, made from the
    job's spec, gives the shapes and dtypes; float32 values cross as one buffer, the rest (step counts, seed
    states, other floats) as their bytes."""
    if commit.epochs is None:  # a joiner: its model as the spec made it, overwritten below
        commit.take(model, epochs)
    floats = [i for i, v in enumerate(commit.values) if v.dtype == np.float32]
    others = [i for i, v in enumerate(commit.values) if v.dtype != np.float32]
    flat = np.concatenate([commit.values[i].ravel() for i in floats] or [np.zeros(0, np.float32)])
    raw = np.concatenate([np.frombuffer(np.ascontiguousarray(commit.values[i]).tobytes(), np.uint8) for i in others]
                         + [np.frombuffer(np.float64(lr_factor).tobytes(), np.uint8)])
    collective.broadcast(flat, root=0)
    collective.broadcast(raw, root=0)
    if collective.rank == 0:
        return lr_factor
    at = 0
    for i in floats:
        v = commit.values[i]
        commit.values[i] = flat[at:at + v.size].reshape(v.shape).copy()
        at += v.size
    at = 0
    for i in others:
        v = commit.values[i]
        commit.values[i] = np.frombuffer(raw[at:at + v.nbytes].tobytes(), v.dtype).reshape(v.shape)
        at += v.nbytes
    commit.put(model)
    commit.epochs, commit.steps = epochs, optimizer_steps(model)
    return float(np.frombuffer(raw[at:at + 8].tobytes(), np.float64)[0])


def run_elastic(link: Any, job: JobMessage, model: Any, lr_factor: float,
                connect: Callable[[Any, JobMessage], Any], make_model: Callable[[JobMessage], Any],
                fit: Callable[..., None]) -> None:
    """Train generation after generation until one finishes (module docstring).

    ``connect(link, job)`` opens a generation's collective, ``make_model(job)`` makes the model anew from the
    job's spec, ``fit(link, job, model, collective, lr_factor, extra_callbacks)`` trains it (allreduce_fit.py)."""
    commit = Commit()
    requests = JoinRequests(link)
    holds_state = int(job.train.generation) == 0  # a worker joining a later generation is given the state
    while True:
        collective = None
        ended = False
        try:
            collective = connect(link, job)
            if int(job.train.generation) > 0:
                lr_factor = share_commit(collective, model, commit, int(job.train.initial_epoch), lr_factor)
                holds_state = True
            join = JoinPoint(requests, int(job.train.generation), collective)
            fit(link, job, model, collective, lr_factor, [CommitCallback(commit, join.at_commit)])
            return
        except GenerationEnds:
            ended = True
        except Exception as exc:
            error = link.error_report(exc)
        finally:
            if collective is not None:
                collective.close()
        generation = int(job.train.generation)
        if ended:  # every member stopped at this commit: its model is the commit, nothing lost
            log.info("worker %d: generation %d ends at the commit after %d epochs for workers joining",
                     job.rank, generation, commit.epochs)
            link.send(AtCommit(generation, int(commit.epochs)))
        elif not holds_state:  # joined, and broke before rank 0's commit came: nothing to go on from
            link.send(Lost(generation, -1, 0, error.exception, error.message, error.traceback, error.raised_type,
                           error.raised_message))
            next_generation(link, job, generation)  # the driver stops it (a later job would be a mistake)
            raise RuntimeError(f"worker {job.rank} was sent a job after it joined without the state")
        else:
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
