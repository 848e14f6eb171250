"""A worker's training run under ``--strategy allreduce`` (the model is built, the collective open)."""
from __future__ import annotations

import logging
import math
from typing import Any

from ..wire.messages import JobMessage
from ..wire.reports import Done, WorkerWarning

log = logging.getLogger("nbdist.worker")


def fit_allreduce(link: Any, job: JobMessage, model: Any, collective: Any,
                  lr_factor: float = 1.0, extra_callbacks: list[Any] | None = None, last: bool = True) -> None:
    """``extra_callbacks``: after the strategy's and the event stream's (an elastic run's commits, elastic.py).
    ``last=False``: an elastic run's rest of a resumed epoch, which the same generation's next fit follows (no
    ``Done``)."""
    import keras

    from ..data.sharding import share_count
    from ..model.spec import averaged_optimizer_variables
    from ..model.tensors import float_buffers
    from ..strategies.allreduce_hook import AllreduceCallback, GradientAllreduce, broadcast_state, wrap_optimizer
    from ..strategies.averaging import WeightedAverager, batch_sizes
    from ..strategies.backend_grads import HostGradientAllreduce, wrap_jax_optimizer, wrap_torch_optimizer
    from ..strategies.gradient_sum import shard_samples, step_totals
    from ..strategies.shared import aligned_offsets
    from .blocks import MAX_BLOCK, StepBlocks, block_size
    from .callbacks import EventCallback, WeightShipper
    from .datasets import job_inputs, rank_batch_size
    from .device import engine_plan, training_device
    from .fit_sync import fit_and_report
    from .phases import EpochPhases, phase_callbacks, phase_timer, phase_times_enabled
    from .pydatasets import ShareAllreduceCallback, job_feed

    rank, train = job.rank, job.train
    # One worker: nothing to sum, so Keras' own step trains, with no hook, no copy and no collective.
    solo = collective.world_size == 1

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
    shares: list[int] = []
    if reader is not None:  # rows known as read: each step's total is summed just before it
        totals, steps = None, share_count(reader.epoch_batches, 0, collective.world_size)
    else:
        # Every step's total samples, known up front: the gradients are scaled by n / total as they
        # are copied into the bucket. len(totals) is the steps every worker runs per epoch.
        shares = shard_samples(collective, samples)
        totals = step_totals(shares, train.batch_sizes or batch_size)
        steps = len(totals)
    # The engine, from facts every worker shares (machine/engines.py); JAX's psum needs every step's rows equal
    # (one program on every process): array data, equal shares and batch sizes.
    equal = len(set(shares)) == 1 and len(set(train.batch_sizes or [batch_size])) == 1
    bucket = 4 * (int(aligned_offsets([int(math.prod(v.shape)) for v in model.trainable_variables])[-1]) + 1)
    plan = engine_plan(collective, train, "allreduce", bucket, equal if backend == "jax" else None)
    if plan.notice:
        log.warning("%s", plan.notice)
        link.send(WorkerWarning(plan.notice))
    engine = plan.engine_name
    log.info("worker %d: allreduce on engine %s (%s)", rank, engine, plan.summed_by)
    reducer = (HostGradientAllreduce if host else GradientAllreduce)(collective, model.trainable_variables, plan)
    if totals is not None and reducer.sums_on_host and not host and not model.run_eagerly:
        # Each step finds its share in the graph, so a call may run several (blocks.py). The device sum
        # (device_sum.py) is told each step's share from Python, as on a GPU.
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
    callbacks += list(extra_callbacks or [])
    if reducer.scheduled:  # several steps per call into TensorFlow (blocks.py)
        train_steps = int(inputs["steps_per_epoch"])
        # TerminateOnNaN(raise_error=True), TensorBoard's batch summaries act at every step, as locally.
        cap = 1 if job.train.step_by_step else MAX_BLOCK
        # An elastic run's commit every K steps ends a call (elastic.py).
        every = int(train.commit_every) if train.elastic and train.commit_every else train_steps
        blocks = StepBlocks(block_size(every, train_steps, cap), train_steps, inputs.get("validation_steps"),
                            after_train_step=reducer.advance)
        callbacks.insert(0, blocks.install(model))
    if feed is not None:
        callbacks = feed.callbacks(event) + callbacks
    try:
        report = fit_and_report(link, job, model, collective, inputs, lr_factor, callbacks, phases, feed, shipper)
        reducer.final_check()
    finally:
        reducer.close()  # no hook stays on the model's tensors, no thread of the sum runs
    if not last:
        return
    link.send(Done(sync_seconds=reducer.seconds, rounds=reducer.steps, engine=engine, padded_steps=sync.padded_steps,
                   summed_by=reducer.summed_by, device=training_device(),
                   **report))
    log.info("worker %d finished (%d allreduce steps, %d padded, %.2f s synchronising)",
             rank, reducer.steps, sync.padded_steps, reducer.seconds)


def _install_jax_engine(model: Any, collective: Any, timeout: float) -> None:
    """Join the workers' JAX job (the coordinator agreed through the store) and make Keras' step sum inside."""
    import jax

    from ..strategies.jax_device_sum import JaxDeviceSum, join_jax_job

    join_jax_job(model, collective, collective.store.host, timeout, jax.default_backend() == "gpu")
    JaxDeviceSum(model).install()
