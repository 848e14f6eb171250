"""The training job as a worker runs it: the notebook's model with its state, rendezvous, fit."""
from __future__ import annotations

import logging
import math
import os
from typing import Any

from ..wire.commands import Rendezvous
from ..wire.messages import JobMessage
from ..wire.reports import Done, Progress, Store, WorkerWarning

log = logging.getLogger("nbdist.worker")


def scale_learning_rate(model: Any, mode: str, world_size: int) -> float:
    """Scale the rate for the workers; returns the factor applied (1.0: none)."""
    from ..strategies.lr_scaling import lr_scale_factor

    opt = model.optimizer
    factor = lr_scale_factor(mode, type(opt).__name__, world_size)
    if factor == 1.0:
        return 1.0
    if not hasattr(opt.learning_rate, "assign"):  # a schedule: the user owns its shape
        log.warning("learning rate is a schedule; not scaling it by %g", factor)
        return 1.0
    opt.learning_rate.assign(float(opt.learning_rate.numpy()) * factor)
    log.info("learning rate scaled by %g for %d workers (lr_scaling=%s)", factor, world_size, mode)
    return factor


def connect_collective(link: Any, job: JobMessage) -> Any:
    from ..strategies.collective import GlooCollective, SoloCollective, open_store_listener

    rank, world, train, place = job.rank, job.world_size, job.train, job.placement
    if world == 1:
        return SoloCollective()
    if place.meet == "host":
        from ..strategies.host_collective import HostCollective, make_meeting_place

        if rank == 0:
            link.send(Store("", 0, make_meeting_place()))
        rdv = link.expect(Rendezvous, timeout=float(train.startup_timeout))
        return HostCollective(rank, world, rdv.path, float(train.sync_timeout))
    listen_fd = None
    if rank == 0:
        bind, advertise = place.bind_host, place.advertise_host
        if place.store_on_link:  # on a Spark executor: this host's address toward the driver
            bind = advertise = link.channel.sock.getsockname()[0]
        listen_fd, port = open_store_listener(bind)
        link.send(Store(advertise, port))
    rdv = link.expect(Rendezvous, timeout=float(train.startup_timeout))
    return GlooCollective(rank, world, rdv.host, rdv.port, float(train.sync_timeout),
                          listen_fd=listen_fd, ifname=place.gloo_ifname)


def build_model(job: JobMessage) -> tuple[Any, float]:
    """The job's model made from its spec, ready for the strategy; the learning-rate factor applied."""
    import keras

    from ..model.spec import build_optimizer, model_from_spec

    train = job.train
    # The notebook's model as it is, with its whole state; the step count comes with it (Adam's bias
    # correction and LR schedules continue).
    model = model_from_spec(job.model)
    # Keras' fit starts at ``model._initial_epoch`` when set (BackupAndRestore's restore travels with the
    # pickled model): the job's initial_epoch is where this launch starts (a relaunch starts later).
    model._initial_epoch = None
    # One step per Keras call unless the averaging path installs its own calls of several (blocks.py):
    # Keras' own would run past an epoch's end on the repeated pipelines.
    model.steps_per_execution = 1
    on_tf = keras.backend.backend() == "tensorflow"
    # Sums inside the train step are Python ops, which XLA cannot compile: the gradient allreduce, and averaging
    # every step's masked-loss counts (global_mask.py). One worker sums nothing: Keras' own step.
    sums_in_step = train.strategy == "allreduce" or (train.strategy == "averaging"
                                                     and int(train.averaging_frequency) == 1)
    if sums_in_step and on_tf and job.world_size > 1:
        model.jit_compile = False

    build_optimizer(model)
    if on_tf and train.fused_updates is not False:
        from ..strategies.fused_updates import FUSED_MIN_PARAMETERS, install_fused_updates

        install_fused_updates(model, 0 if train.fused_updates else FUSED_MIN_PARAMETERS)
    from .fit_sync import set_initial_learning_rate

    set_initial_learning_rate(model, job)
    # async too: each delta counts 1/N on the driver, so the scaled local rate gives the shared model allreduce's step.
    lr_factor = scale_learning_rate(model, train.lr_scaling, job.world_size)
    return model, lr_factor


def run_training(link: Any, job: JobMessage) -> None:
    rank, train = job.rank, job.train
    link.heartbeat_timeout = float(job.heartbeat_timeout)
    import keras

    from ..strategies.averaging import WeightedAverager
    from .blocks import MAX_BLOCK, StepBlocks, block_size
    from .callbacks import AveragingCallback, EventCallback, WeightShipper
    from .datasets import job_inputs, rank_batch_size
    from .pydatasets import job_feed

    if train.seed is not None:  # the run's seed (model/seeding.py): without importing TensorFlow on JAX or torch
        from ..model.seeding import seed_worker

        seed_worker(int(train.seed) + rank, keras.backend.backend())
    model, lr_factor = build_model(job)
    on_tf = keras.backend.backend() == "tensorflow"
    from ..machine.placement import GPUS_ASKED, gpu_missing_notice
    from .device import training_device
    from .fit_sync import fit_and_report

    device = training_device()  # in the run's state and dashboard from here on, and in the closing report
    link.send(Progress("starting", epoch=train.initial_epoch, device=device))
    missing = gpu_missing_notice(train.engine, device, os.environ.get(GPUS_ASKED) == "1")
    if missing and (train.engine != "nccl" or job.world_size == 1):  # else the engine's choice refuses it
        link.send(WorkerWarning(missing))

    if train.strategy == "async":  # no collective: every exchange is with the driver (async_fit.py)
        from .async_fit import fit_async

        link.send(Done(device=device, **fit_async(link, job, model)))
        return
    from .phases import EpochPhases, PhaseClock, PhaseCollective, phase_callbacks, phase_timer, phase_times_enabled

    # Watched, so the worker can report time in synchronisation vs compute (see phases.py).
    watched = lambda link, job: PhaseCollective(connect_collective(link, job), PhaseClock())
    if train.strategy == "allreduce" and train.elastic:  # generation after generation (elastic.py)
        from .allreduce_fit import fit_allreduce
        from .elastic import run_elastic

        run_elastic(link, job, model, lr_factor, watched, lambda job: build_model(job)[0], fit_allreduce)
        return
    collective = watched(link, job)
    if train.strategy == "allreduce":
        from .allreduce_fit import fit_allreduce

        try:
            fit_allreduce(link, job, model, collective, lr_factor)
        finally:
            collective.close()
        return
    averager = None
    try:
        from ..model.spec import averaged_optimizer_variables
        from ..model.tensors import float_buffers

        variables = [w for w in model.weights if "float" in str(w.dtype)] + float_buffers(model)
        if train.average_optimizer:
            variables += averaged_optimizer_variables(model)
        from .device import device_averager, engine_plan

        # One selector (machine/engines.py): the rounds on the devices (device_sum.py,
        # jax_device_sum.py), else through the host, in shared memory when every worker runs on this machine.
        flat_bytes = 4 * (sum(math.prod(int(d) for d in v.shape) for v in variables) + 1)
        plan = engine_plan(collective, train, "averaging", flat_bytes)
        averager = device_averager(collective, model, variables, plan)
        if averager is None:
            averager = WeightedAverager(collective, variables, compiled=on_tf, plan=plan)
        batch_size = rank_batch_size(job)
        # A PyDataset: this worker's share of its batches (pydatasets.py); arrays: one repeated
        # pipeline for the whole fit, so Keras keeps one iterator (see datasets.py).
        feed = job_feed(job, batch_size)
        inputs, samples, val_samples = (feed.inputs, feed.samples, feed.val_samples) if feed else job_inputs(job)
        sizes = feed.sizes if feed else None

        phases = EpochPhases(averager) if phase_times_enabled() else None
        shipper = (WeightShipper(link.send, model, bool(train.weights_every_epoch), int(train.epochs))
                   if rank == 0 else None)
        link.on_stop = shipper.on_stop if shipper is not None else None
        ship = shipper
        if phases is not None:
            ship = phases.wrap_shipper(ship)

        event = EventCallback(link.send, samples, val_samples, batch_size, phase_timer(collective, averager),
                              ship, sizes=sizes)
        callbacks = [event] + phase_callbacks(link.send, collective)
        if feed is None and on_tf and not model.run_eagerly:  # several steps per call into TensorFlow (blocks.py)
            steps = int(inputs["steps_per_epoch"])
            # TerminateOnNaN(raise_error=True), TensorBoard's batch summaries act at every step, as locally.
            block = block_size(int(train.averaging_frequency), steps, 1 if train.step_by_step else MAX_BLOCK)
            if block > 1:
                callbacks.insert(0, StepBlocks(block, steps, inputs.get("validation_steps")).install(model))
        if collective.world_size > 1:  # a batch hook costs every step its async dispatch
            averaging = AveragingCallback(averager, int(train.averaging_frequency), samples,
                                          batch_size, int(train.rounds_per_epoch), sizes=sizes)
            if int(train.averaging_frequency) == 1:  # every step one round: masked losses as one local step
                from .global_mask import GlobalMaskNormaliser

                normaliser = GlobalMaskNormaliser(collective)
                normaliser.install(model)
                averaging.before_pad = normaliser.pad
            callbacks.insert(0, averaging)
        if feed is not None:
            callbacks = feed.callbacks(event) + callbacks
        report = fit_and_report(link, job, model, collective, inputs, lr_factor, callbacks, phases, feed, shipper)
        link.send(Done(sync_seconds=averager.seconds, rounds=averager.rounds, summed_by=averager.summed_by,
                       device=device, **report))
    finally:
        if averager is not None:
            averager.close()
        collective.close()
    log.info("worker %d finished (%d averaging rounds, %.2f s synchronising)",
             rank, averager.rounds, averager.seconds)
