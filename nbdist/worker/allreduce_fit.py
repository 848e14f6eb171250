"""A worker's training run under ``--strategy allreduce`` (the model is built, the collective open)."""
from __future__ import annotations

import logging
from typing import Any

from ..wire.messages import JobMessage
from ..wire.reports import Done, WorkerWarning

log = logging.getLogger("nbdist.worker")


def jax_engine(requested: str | None, collective: Any = None) -> tuple[str, str | None]:
    """The engine on Keras' JAX backend (``placement.choose_jax_engine``): JAX's own collectives inside the
    jitted step where every worker has a GPU of its own, else Gloo through a host call; ``--engine`` decides
    when given. Every worker sums the GPUs (every one asked the same), so all choose alike."""
    from ..machine.placement import choose_jax_engine
    from .device import worker_gpus

    gpus = worker_gpus(collective) if requested != "gloo" and collective is not None else ()
    return choose_jax_engine(requested, None, gpus)


def resolve_engine(requested: str | None, collective: Any) -> tuple[str, str | None]:
    import keras

    from ..machine.placement import choose_engine, choose_torch_engine, horovod_import_error, nccl_or_gloo
    from .device import worker_gpus

    backend = keras.backend.backend()
    if backend == "jax":
        return jax_engine(requested, collective)
    if backend == "torch":  # NCCL only where every worker has a GPU of its own
        return choose_torch_engine(requested, worker_gpus(collective))
    import tensorflow as tf

    has_gpu = bool(tf.config.list_physical_devices("GPU"))
    horovod_error = horovod_import_error() if requested == "horovod" else None
    gpus = worker_gpus(collective)  # every worker sums this, whatever it chooses: one order of collectives
    engine, warning = choose_engine(requested, has_gpu, horovod_error)
    return nccl_or_gloo(engine, warning, requested, gpus)


def fit_allreduce(link: Any, job: JobMessage, model: Any, collective: Any,
                  lr_factor: float = 1.0) -> None:
    import keras

    from ..data.sharding import share_count
    from ..model.spec import averaged_optimizer_variables
    from ..model.tensors import float_buffers
    from ..strategies.allreduce_hook import AllreduceCallback, GradientAllreduce, broadcast_state, wrap_optimizer
    from ..strategies.averaging import WeightedAverager, batch_sizes
    from ..strategies.backend_grads import HostGradientAllreduce, wrap_jax_optimizer, wrap_torch_optimizer
    from ..strategies.gradient_sum import shard_samples, step_totals
    from ..strategies.sum_threads import sum_threads
    from .blocks import MAX_BLOCK, StepBlocks, block_size
    from .callbacks import EventCallback, WeightShipper
    from .datasets import job_inputs, rank_batch_size
    from .device import training_device
    from .fit_sync import fit_and_report
    from .phases import EpochPhases, phase_callbacks, phase_timer, phase_times_enabled
    from .pydatasets import ShareAllreduceCallback, job_feed

    rank, train = job.rank, job.train
    # One worker: nothing to sum, so Keras' own step trains, with no hook, no copy and no collective.
    solo = collective.world_size == 1
    engine, warning = ("none", None) if solo else resolve_engine(train.engine, collective)
    if warning:
        log.warning("%s", warning)
        link.send(WorkerWarning(warning))
    log.info("worker %d: allreduce on engine %s", rank, engine)

    floats = lambda vs: [v for v in vs if "float" in str(v.dtype)]
    # Rank 0's weights and optimizer state are everyone's starting point.
    backend = keras.backend.backend()
    host = backend != "tensorflow"  # JAX and torch hand over arrays (backend_grads.py)
    broadcast_state(collective, floats(model.weights) + averaged_optimizer_variables(model), compiled=not host)

    batch_size = rank_batch_size(job)
    # A PyDataset: this worker's share of its batches (pydatasets.py); arrays: one repeated
    # pipeline for the whole fit, so Keras keeps one iterator (see datasets.py).
    feed = job_feed(job, batch_size)
    inputs, samples, val_samples = (feed.inputs, feed.samples, feed.val_samples) if feed else job_inputs(job)
    reader = feed.train if feed else None
    if reader is not None:  # rows known as read: each step's total is summed just before it
        totals, steps = None, share_count(reader.data.batches, 0, collective.world_size)
    else:
        # Every step's total samples, known up front: the gradients are scaled by n / total as they
        # are copied into the bucket. len(totals) is the steps every worker runs per epoch.
        totals = step_totals(shard_samples(collective, samples), train.batch_sizes or batch_size)
        steps = len(totals)
    if engine == "jax":  # one program on every process: every step's rows the same on every worker
        engine = _equal_steps_or_gloo(link, collective, samples if reader is None else None,
                                      train.batch_sizes or [batch_size], train.engine)
    reducer = (HostGradientAllreduce if host else GradientAllreduce)(
        collective, model.trainable_variables, "gloo" if solo or engine == "jax" else engine,
        direct_sum_bytes=int(train.direct_sum_bytes),
        shared_memory=bool(train.shared_memory), shared_chunk_bytes=int(train.shared_chunk_bytes))
    reducer.use_threads(sum_threads(job.threads))  # the budget's cores sum while the model waits (opt-in)
    if totals is not None and engine == "gloo" and not host and not model.run_eagerly and not reducer.device_sum:
        # Each step finds its share in the graph, so a call may run several (blocks.py). The device sum
        # (tf_device_sum.py) is told each step's share from Python, as on a GPU.
        reducer.schedule(batch_sizes(samples, batch_size), totals)
    wrap = {"jax": wrap_jax_optimizer, "torch": wrap_torch_optimizer}.get(backend, wrap_optimizer)
    if engine == "jax":  # the sum inside Keras' jitted step, over JAX's collectives (jax_device_sum.py)
        _install_jax_engine(model, collective, float(train.sync_timeout))
        original_apply = model.optimizer.apply
        reducer.set_weight = lambda *args: None  # the step weights by its own rows (no pad steps: equal shares)
    else:
        original_apply = model.optimizer.apply if solo else wrap(model.optimizer, reducer)
    if backend == "torch" and not solo:  # the device sum's buckets during the backward pass (torch_overlap.py)
        refused = reducer.overlap_backward(model)
        if refused != "no device sum":
            log.info("worker %d: device sum buckets %s", rank, f"at apply ({refused})" if refused else "overlapped")
    if collective.world_size > 1:  # masked losses normalised by the global batch's valid entries
        from .global_mask import GlobalMaskNormaliser

        normaliser = GlobalMaskNormaliser(collective)
        normaliser.install(model)
        reducer.before_pad = normaliser.pad
    non_trainable = floats(model.non_trainable_weights) + float_buffers(model)  # BatchNorm's statistics
    stats = WeightedAverager(collective, non_trainable, compiled=not host) if non_trainable else None

    phases = EpochPhases(reducer) if phase_times_enabled() else None
    shipper = (WeightShipper(link.send, model, bool(train.weights_every_epoch), int(train.epochs))
               if rank == 0 else None)
    link.on_stop = shipper.on_stop if shipper is not None else None
    ship = shipper
    if phases is not None:
        ship = phases.wrap_shipper(ship)

    if reader is not None:
        sync = ShareAllreduceCallback(reducer, original_apply, model.trainable_variables, reader, steps, stats,
                                      collective)
    else:
        sync = AllreduceCallback(reducer, original_apply, model.trainable_variables, samples, batch_size,
                                 steps, stats, totals)
    event = EventCallback(link.send, samples, val_samples, batch_size, phase_timer(collective, reducer), ship,
                          sizes=feed.sizes if feed else None)
    callbacks = ([] if solo else [sync]) + [event] + phase_callbacks(link.send, collective)
    if reducer.scheduled:  # several steps per call into TensorFlow (blocks.py)
        train_steps = int(inputs["steps_per_epoch"])
        # TerminateOnNaN(raise_error=True), TensorBoard's batch summaries act at every step, as locally.
        cap = 1 if job.train.step_by_step else MAX_BLOCK
        blocks = StepBlocks(block_size(train_steps, train_steps, cap), train_steps, inputs.get("validation_steps"),
                            after_train_step=reducer.advance)
        callbacks.insert(0, blocks.install(model))
    if feed is not None:
        callbacks = feed.callbacks(event) + callbacks
    try:
        report = fit_and_report(link, job, model, collective, inputs, lr_factor, callbacks, phases, feed, shipper)
        reducer.final_check()
    finally:
        reducer.close()  # no hook stays on the model's tensors, no thread of the sum runs
    link.send(Done(sync_seconds=reducer.seconds, rounds=reducer.steps, engine=engine, padded_steps=sync.padded_steps,
                   summed_by="device" if engine == "jax" else reducer.summed_by, device=training_device(), **report))
    log.info("worker %d finished (%d allreduce steps, %d padded, %.2f s synchronising)",
             rank, reducer.steps, sync.padded_steps, reducer.seconds)


def _equal_steps_or_gloo(link: Any, collective: Any, samples: int | None, sizes: list[int],
                         requested: str | None) -> str:
    """``jax`` (already chosen for the workers' GPUs) where every worker has the same rows at every step (array
    data, equal shares and batch sizes), else ``gloo`` with its one sentence. ``samples`` None: a PyDataset feed,
    whose last batches may differ."""
    from ..machine.placement import unequal_rows_notice
    from ..strategies.gradient_sum import shard_samples

    shares = shard_samples(collective, samples) if samples is not None else []
    if len(set(shares)) == 1 and len(set(sizes)) == 1:
        return "jax"
    warning = unequal_rows_notice(requested)
    log.warning("%s", warning)
    link.send(WorkerWarning(warning))
    return "gloo"


def _install_jax_engine(model: Any, collective: Any, timeout: float) -> None:
    """Join the workers' JAX job (the coordinator agreed through the store) and make Keras' step sum inside."""
    import jax

    from ..strategies.jax_device_sum import JaxDeviceSum, join_jax_job

    join_jax_job(model, collective, collective.store.host, timeout, jax.default_backend() == "gpu")
    JaxDeviceSum(model).install()
