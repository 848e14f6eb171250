"""An elastic run as a worker runs it (docs/elastic.md): train a generation, commit, roll back, train the next.

``run_elastic`` trains the job's generation under allreduce. At every epoch's start and, given ``commit_every``
K, after every K-th step, the worker copies the model's whole state into memory: the commit at (epoch, step),
the last two kept (a mid-epoch one with the epoch's summed metric state). When the collective breaks it reports
``Lost`` (its commit's point, the steps run past it, the error) and waits for the driver, which alone decides
membership: the next generation's job, trained from a model made anew with the commit put back (resumed mid-epoch:
the rest of that epoch's global batches first), or a stop. Asked by ``JoinAtCommit``, the members stop together
at a commit (``JoinPoint.at_commit``) and report ``AtCommit``: nothing is rolled back. Every later generation
starts with rank 0's commit broadcast over its new collective (``share_commit``): a joiner takes it whole.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import keras
import numpy as np

from ..strategies.averaging import synced_state
from ..wire.commands import GenerationBroken, JoinAtCommit
from ..wire.messages import JobMessage
from ..wire.reports import AtCommit, Lost

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

    def at(self, epoch: int, step: int) -> Snapshot | None:
        """The commit held at (``epoch``, ``step``), if any."""
        return next((s for s in self.held if (s.epoch, s.step) == (epoch, step)), None)

    def put(self, model: Any, epoch: int, step: int) -> Snapshot:
        """The commit at (``epoch``, ``step``) into ``model`` (made from the same spec: the same variables in the
        same order), all of it."""
        snapshot = self.at(epoch, step)
        if snapshot is None:
            held = ", ".join(f"({s.epoch}, {s.step})" for s in self.held)
            raise RuntimeError(f"the next generation resumes at (epoch, step) ({epoch}, {step}), but this worker "
                               f"holds commits at {held}")
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
    """Commits at every epoch's start and every ``every`` steps; ``after(epoch, step)`` then (the generation may
    end there: ``JoinPoint``). ``resume``: the commit this fit starts from: its epoch's steps are counted from its
    step, and rank 0 adds the epoch's summed metric state to its own after the first step (Keras reset the metrics
    at the epoch's start; the others' state is summed at the epoch's end)."""

    batch_end_in_order = True  # its metric sum pairs up with the other workers' (callback_list.py)

    def __init__(self, commit: Commit, collective: Any, rank: int, every: int | None = None,
                 resume: Snapshot | None = None, shared_memory: bool = True,
                 after: Callable[[int, int], None] | None = None) -> None:
        super().__init__()
        self.commit, self.collective, self.rank, self.every, self.after = commit, collective, rank, every, after
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
        if self.after is not None:
            self.after(epoch, 0)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.metrics is not None:  # after the first step: a model made anew builds its metrics in it
            add_metric_state(self.model, self.metrics)
            self.metrics = None
        done = self.offset + batch + 1
        if commit_steps(done, self.every, self.steps):
            self.commit.take(self.model, self.epoch, done, self.summer.total())
            if self.after is not None:
                self.after(self.epoch, done)


def commit_callback(commit: Commit, collective: Any, job: JobMessage, after: Callable[[int, int], None],
                    resume: Snapshot | None = None) -> Any:
    every = job.train.commit_every
    return CommitCallback(commit, collective, job.rank, None if every is None else int(every), resume,
                          bool(job.train.shared_memory), after)


class GenerationEnds(Exception):
    """Raised at a commit where every member stops for workers joining (``JoinPoint``)."""


class JoinRequests:
    """The newest generation the driver asked to end at its next commit (``JoinAtCommit``) and the newest it said is
    broken (``GenerationBroken``), set on the link's reader thread as the notices arrive, so no wait for another
    message drops them and a worker blocked in a collective learns it."""

    def __init__(self, link: Any) -> None:
        self.generation = self.broken = -1
        link.handlers[JoinAtCommit] = self._asked
        link.handlers[GenerationBroken] = self._broken

    def _asked(self, msg: JoinAtCommit) -> None:
        self.generation = max(self.generation, int(msg.generation))

    def _broken(self, msg: GenerationBroken) -> None:
        self.broken = max(self.broken, int(msg.generation))

    def heeded_by(self, collective: Any, generation: int) -> None:
        """``collective``'s waits end once the driver says ``generation`` is broken (strategies/collective.py)."""
        inner = getattr(collective, "inner", collective)  # PhaseCollective wraps the engine
        if hasattr(inner, "broken"):
            inner.broken = lambda: (f"the driver gave generation {generation} up: a member is gone"
                                    if self.broken >= generation else None)


class JoinPoint:
    """Where generation ``generation`` ends for workers waiting to join: ``at_commit``, after every commit but the
    one the generation started from (``start``). Whether the driver asked may reach the members at different
    moments, so they sum what each was told over their collective: all stop at the same commit, or none does."""

    def __init__(self, requests: JoinRequests, job: JobMessage, collective: Any) -> None:
        self.requests, self.generation, self.collective = requests, int(job.train.generation), collective
        self.start = (int(job.train.initial_epoch), int(job.train.resume_step))

    def at_commit(self, epoch: int, step: int) -> None:
        if (epoch, step) == self.start:
            return
        asked = np.array([1.0 if self.requests.generation >= self.generation else 0.0])
        self.collective.allreduce_sum(asked)
        if asked[0] > 0:
            raise GenerationEnds(f"generation {self.generation} ends at the commit after {epoch} epochs and {step} "
                                 "steps")


def share_commit(collective: Any, model: Any, commit: Commit, epoch: int, step: int,
                 lr_factor: float) -> tuple[Snapshot, float]:
    """Rank 0's commit at (``epoch``, ``step``), all of it, to every worker of a new generation, put into their
    models; returns it and rank 0's learning-rate factor (the launch's, which a joiner made for another world). A
    joiner's model, made from the job's spec, gives the shapes and dtypes; float32 values cross as one buffer, the
    rest (step counts, seed states, other floats) as their bytes. The epoch's metric state stays rank 0's, which
    alone adds it (``CommitCallback``); a joiner is never rank 0 of the generation it joins."""
    if commit.at(epoch, step) is None:  # a joiner: its model as the spec made it, overwritten below
        commit.take(model, epoch, step)
    snapshot = commit.at(epoch, step)
    values = snapshot.values
    floats = [i for i, v in enumerate(values) if v.dtype == np.float32]
    others = [i for i, v in enumerate(values) if v.dtype != np.float32]
    flat = np.concatenate([values[i].ravel() for i in floats] or [np.zeros(0, np.float32)])
    raw = np.concatenate([np.frombuffer(np.ascontiguousarray(values[i]).tobytes(), np.uint8) for i in others]
                         + [np.frombuffer(np.float64(lr_factor).tobytes(), np.uint8)])
    collective.broadcast(flat, root=0)
    collective.broadcast(raw, root=0)
    if collective.rank == 0:
        return snapshot, lr_factor
    at = 0
    for i in floats:
        values[i] = flat[at:at + values[i].size].reshape(values[i].shape).copy()
        at += values[i].size
    at = 0
    for i in others:
        v = values[i]
        values[i] = np.frombuffer(raw[at:at + v.nbytes].tobytes(), v.dtype).reshape(v.shape).copy()
        at += v.nbytes
    commit.put(model, epoch, step)
    snapshot.iterations = optimizer_steps(model)
    return snapshot, float(np.frombuffer(raw[at:at + 8].tobytes(), np.float64)[0])


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
    requests = JoinRequests(link)
    holds_state = int(job.train.generation) == 0  # a worker joining a later generation is given the state
    resume: Snapshot | None = None
    while True:
        collective = None
        ended = False
        try:
            collective = connect(link, job)
            requests.heeded_by(collective, int(job.train.generation))
            point = (int(job.train.initial_epoch), int(job.train.resume_step))
            if int(job.train.generation) > 0:
                resume, lr_factor = share_commit(collective, model, commit, *point, lr_factor)
                holds_state = True
            after = JoinPoint(requests, job, collective).at_commit
            if resume is not None and resume.step:
                last = point[0] + 1 >= int(job.train.epochs)
                fit(link, rest_of_epoch(job, resume.step), model, collective, lr_factor,
                    [commit_callback(commit, collective, job, after, resume)], last)
                if last:
                    return
                job = following_epochs(job)
                model = moved(model, make_model(job))  # a fit's hooks and compiled step are its model's alone
            fit(link, job, model, collective, lr_factor, [commit_callback(commit, collective, job, after)])
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
            held = commit.latest
            log.info("worker %d: generation %d ends at the commit after %d epochs and %d steps for workers joining",
                     job.rank, generation, held.epoch, held.step)
            link.send(AtCommit(generation, held.epoch, held.step))
        elif not holds_state:  # joined, and broke before rank 0's commit came: nothing to go on from
            link.send(Lost(generation, -1, 0, error.exception, error.message, error.traceback, error.raised_type,
                           error.raised_message))
            next_generation(link, job, generation)  # the driver stops it (a later job would be a mistake)
            raise RuntimeError(f"worker {job.rank} was sent a job after it joined without the state")
        else:
            if commit.latest is None:  # broke before its first epoch began: the job as it came is the commit
                commit.take(model, int(job.train.initial_epoch), int(job.train.resume_step))
            held, lost = commit.latest, commit.steps_past(model)
            log.warning("worker %d: generation %d broke (%s); holding the commit after %d epochs and %d steps, %d "
                        "steps past it", job.rank, generation, error.message, held.epoch, held.step, lost)
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
