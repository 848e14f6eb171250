"""An elastic run as a worker runs it (docs/elastic.md): train a generation, commit, roll back, train the next.

Contract: ``run_elastic`` trains the job's generation under allreduce. At the start of every epoch (so after
the previous epoch's metrics, validation and the driver's decision) and, given ``commit_every`` K, after every
K-th step of an epoch, the worker copies the model's whole state into its own memory: the commit, at (epoch,
step). A mid-epoch commit also holds the epoch's metric state so far, summed over the workers. The worker keeps
its last two commits. When the generation's collective breaks (a peer died: shared memory's ``PeerGone``,
Gloo's closed connection; or anything else raised), it closes that collective, reports ``Lost`` (its last
commit's point, the steps it had run past it, the error) and waits for the driver, which alone decides
membership: either the next generation's job (a new rank, world and shard, the same model spec, the point to
resume from), trained from a model made anew from that spec with the commit put back into it; or a stop, which
ends the process. Resumed mid-epoch, the worker first trains the rest of that epoch on its rows from that step
on (each global batch is dealt over the workers in order, so these are the epoch's remaining global batches),
with the committed metric state put back, then the following epochs. Under allreduce every worker holds the
same state at a commit, so a survivor needs nobody's copy.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from ..strategies.averaging import synced_state
from ..wire.messages import JobMessage
from ..wire.reports import Lost

log = logging.getLogger("nbdist.worker")


@dataclasses.dataclass
class Snapshot:
    """The state at one commit: after ``epoch`` epochs and ``step`` steps of the next."""

    epoch: int
    step: int
    iterations: int  # the optimizer's step count
    values: list[np.ndarray]
    metrics: np.ndarray | None = None  # the epoch's metric state so far, summed over the workers (step > 0)


class Commit:
    """The model's state in this worker's memory: every variable of the model and of its optimizer (weights,
    slots, step count, learning rate, seed generators) and a torch model's float buffers; the last two commits,
    so that a worker that committed once more than another can roll back as far as it."""

    def __init__(self) -> None:
        self.held: list[Snapshot] = []  # oldest first, at most two

    @property
    def latest(self) -> Snapshot | None:
        return self.held[-1] if self.held else None

    def take(self, model: Any, epoch: int, step: int = 0, metrics: np.ndarray | None = None) -> None:
        from ..model.spec import host_array

        synced_state(model)  # JAX: the running fit's state into the variables first
        variables = state_variables(model)
        spare = self.held.pop(0) if len(self.held) == 2 else None
        # One copy from where the backend holds each value (TensorFlow on the CPU: a view of its memory), into
        # the older commit's buffers once there are two: no fresh pages for hundreds of MB at every commit.
        if spare is not None and [a.shape for a in spare.values] == [tuple(v.shape) for v in variables]:
            for buffer, v in zip(spare.values, variables):
                np.copyto(buffer, host_array(v), casting="unsafe")
            values = spare.values
        else:
            values = [np.array(host_array(v), copy=True) for v in variables]
        self.held.append(Snapshot(epoch, step, optimizer_steps(model), values, metrics))

    def steps_past(self, model: Any) -> int:
        """Steps ``model`` has applied since the last commit: what a rollback loses (a step that broke applied
        none). 0 where a broken fit left its state unreadable (JAX's donated buffers)."""
        try:
            synced_state(model)
            return max(0, optimizer_steps(model) - self.latest.iterations)
        except Exception as exc:
            log.info("the steps past the commit cannot be read from the broken fit: %s", exc)
            return 0

    def put(self, model: Any, epoch: int, step: int) -> Snapshot:
        """The commit at (``epoch``, ``step``) into ``model`` (made from the same spec: the same variables in the
        same order), all of it."""
        found = [s for s in self.held if (s.epoch, s.step) == (epoch, step)]
        if not found:
            held = ", ".join(f"({s.epoch}, {s.step})" for s in self.held)
            raise RuntimeError(f"the next generation resumes at (epoch, step) ({epoch}, {step}), but this worker "
                               f"holds commits at {held}")
        snapshot = found[0]
        variables = state_variables(model)
        if len(variables) != len(snapshot.values):
            raise RuntimeError(f"the commit holds {len(snapshot.values)} variables and the model {len(variables)}")
        for v, value in zip(variables, snapshot.values):
            v.assign(value)
        return snapshot


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


def commit_steps(done: int, every: int | None, steps: int) -> bool:
    """Whether the step that makes ``done`` steps of an epoch of ``steps`` ends with a commit: every ``every``
    steps, but not at the epoch's last (the next epoch's start commits after its metrics and decisions)."""
    return every is not None and done % every == 0 and done < steps


class CommitCallback(keras.callbacks.Callback):
    """Commits at every epoch's start and every ``every`` steps. ``resume``: the commit this fit starts from: its
    epoch's steps are counted from its step, and rank 0 adds the epoch's summed metric state to its own after the
    first step (Keras reset the metrics at the epoch's start; the others' state is summed at the epoch's end)."""

    batch_end_in_order = True  # its metric sum pairs up with the other workers' (callback_list.py)

    def __init__(self, commit: Commit, collective: Any, rank: int, every: int | None = None,
                 resume: Snapshot | None = None, shared_memory: bool = True) -> None:
        super().__init__()
        self.commit, self.collective, self.rank, self.every = commit, collective, rank, every
        self.resume, self.shared_memory = resume, shared_memory
        self.epoch, self.offset, self.steps = 0, 0, 0
        self.summer: Any = None
        self.metrics: np.ndarray | None = None  # the resumed epoch's metric state, to add once built

    def on_train_begin(self, logs: Any = None) -> None:
        from .fit_sync import MetricStateSum

        if self.every is not None:
            self.summer = MetricStateSum(self.collective, self.model, self.shared_memory)

    def on_train_end(self, logs: Any = None) -> None:
        if self.summer is not None:
            self.summer.close()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.epoch, self.offset = epoch, 0
        self.steps = int((self.params or {}).get("steps") or 0)
        resume, self.resume = self.resume, None
        if resume is not None and resume.epoch == epoch and resume.step:
            self.offset = resume.step
            self.steps += resume.step
            if self.rank == 0:
                self.metrics = resume.metrics
            return
        self.commit.take(self.model, epoch)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.metrics is not None:  # after the first step: a model made anew builds its metrics in it
            add_metric_state(self.model, self.metrics)
            self.metrics = None
        done = self.offset + batch + 1
        if commit_steps(done, self.every, self.steps):
            self.commit.take(self.model, self.epoch, done, self.summer.total())


def commit_callback(commit: Commit, collective: Any, job: JobMessage, resume: Snapshot | None = None) -> Any:
    every = job.train.commit_every
    return CommitCallback(commit, collective, job.rank, None if every is None else int(every), resume,
                          bool(job.train.shared_memory))


def add_metric_state(model: Any, flat: np.ndarray) -> None:
    """A summed metric state (``MetricStateSum.total``) added to the model's metric variables: the variables
    are totals and counts, so the sum covers the steps of both."""
    from .fit_sync import MetricStateSum

    synced_state(model)
    variables = MetricStateSum(None, model).variables()
    if sum(int(np.prod(v.shape)) for v in variables) != flat.size:
        raise RuntimeError("the commit's metric state does not fit the model's metrics")
    offset = 0
    for v in variables:
        now = np.asarray(keras.ops.convert_to_numpy(v))
        part = flat[offset:offset + now.size].reshape(now.shape) + now.astype(np.float64)
        offset += now.size
        v.assign(np.round(part).astype(now.dtype) if now.dtype.kind in "iu" else part.astype(now.dtype))


def rest_of_epoch(job: JobMessage, step: int) -> JobMessage:
    """The job that trains epoch ``initial_epoch`` from its ``step``-th step: this worker's rows from its batch
    ``step`` on, one epoch. Its rows are dealt global batch by global batch (data/sharding.py: ``deal_rows``),
    so these are its parts of the epoch's remaining global batches."""
    from .datasets import rank_batch_size

    if job.data_source != "wire" or job.py_datasets is not None or job.train.steps_per_epoch:
        raise RuntimeError("resuming an epoch at a step needs the training rows as arrays sent to the workers "
                           "(not a memory-mapped file, a PyDataset or fit's steps_per_epoch); drop commit_every")
    from ..data.structures import map_struct

    start = step * rank_batch_size(job)
    cut = lambda struct: map_struct(lambda a: a[start:], struct)
    return dataclasses.replace(job, x=cut(job.x), y=cut(job.y), sample_weight=cut(job.sample_weight),
                               train=dataclasses.replace(job.train, epochs=int(job.train.initial_epoch) + 1))


def moved(model: Any, fresh: Any) -> Any:
    """``fresh`` (made from ``model``'s spec) holding ``model``'s whole state."""
    synced_state(model)
    for source, target in zip(state_variables(model), state_variables(fresh), strict=True):
        target.assign(keras.ops.convert_to_numpy(source))
    return fresh


def following_epochs(job: JobMessage) -> JobMessage:
    """The job that trains the epochs after a resumed one."""
    return dataclasses.replace(job, train=dataclasses.replace(
        job.train, initial_epoch=int(job.train.initial_epoch) + 1, resume_step=0))


def run_elastic(link: Any, job: JobMessage, model: Any, lr_factor: float,
                connect: Callable[[Any, JobMessage], Any], make_model: Callable[[JobMessage], Any],
                fit: Callable[..., None]) -> None:
    """Train generation after generation until one finishes (module docstring).

    ``connect(link, job)`` opens a generation's collective, ``make_model(job)`` makes the model anew from the
    job's spec, ``fit(link, job, model, collective, lr_factor, extra_callbacks, last)`` trains it
    (allreduce_fit.py; ``last=False``: a resumed epoch's rest, after which this generation trains on)."""
    commit = Commit()
    resume: Snapshot | None = None
    while True:
        collective = None
        try:
            collective = connect(link, job)
            if resume is not None and resume.step:
                last = int(job.train.initial_epoch) + 1 >= int(job.train.epochs)
                fit(link, rest_of_epoch(job, resume.step), model, collective, lr_factor,
                    [commit_callback(commit, collective, job, resume)], last)
                if last:
                    return
                job = following_epochs(job)
                model = moved(model, make_model(job))  # a fit's hooks and compiled step are its model's alone
            fit(link, job, model, collective, lr_factor, [commit_callback(commit, collective, job)])
            return
        except Exception as exc:
            error = link.error_report(exc)
        finally:
            if collective is not None:
                collective.close()
        generation = int(job.train.generation)
        if commit.latest is None:  # broke before its first epoch began: the job as it came is the commit
            commit.take(model, int(job.train.initial_epoch), int(job.train.resume_step))
        held, lost = commit.latest, commit.steps_past(model)
        log.warning("worker %d: generation %d broke (%s); holding the commit after %d epochs and %d steps, %d steps "
                    "past it", job.rank, generation, error.message, held.epoch, held.step, lost)
        link.send(Lost(generation, held.epoch, lost, error.exception, error.message, error.traceback,
                       error.raised_type, error.raised_message, step=held.step))
        job = next_generation(link, job, generation)
        model = make_model(job)
        resume = commit.put(model, int(job.train.initial_epoch), int(job.train.resume_step))


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
