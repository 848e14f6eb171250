"""The gradient sum on Keras' JAX backend inside the jitted step (``--engine jax``), and averaging rounds the
same way: ``jax.lax.psum`` over one ``jax.distributed`` job of one device per worker (NCCL on GPUs, Gloo on CPUs).

Invariants: every process runs the same program, so the engine is chosen only where every step has the same
rows on every worker (machine/engines.py); the sums are weighted by rows as the host path's are; joining the
job keeps the model's state (``join_jax_job``); the job's heartbeat ends a run whose peer died.
"""
from __future__ import annotations

import gc
import logging
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np

from .averaging import Averager

log = logging.getLogger("nbdist.worker")

PORT_KEY = "nbdist/jax/coordinator"
AXIS = "workers"  # the mesh's one axis: the worker processes


def free_port(host: str) -> int:
    """A port free on ``host`` now (the coordinator binds it a moment later; a race only fails the start)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def coordinator_address(collective: Any, host: str) -> str:
    """Rank 0's ``host:port`` for JAX's coordinator, agreed through the workers' rendezvous store (the store's
    own waits are bounded by nbdist's sync timeout)."""
    store = collective.store
    if collective.rank == 0:
        address = f"{f'[{host}]' if ':' in host else host}:{free_port(host)}"
        store.set(PORT_KEY, address)
        return address
    return store.get(PORT_KEY).decode()


def model_variables(model: Any) -> list[Any]:
    """Every Keras variable the fit uses: the model's (seeds included), the optimizer's and the metrics'."""
    seen: dict[int, Any] = {}
    optimizer = getattr(model, "optimizer", None)
    for v in [*model.variables, *(optimizer.variables if optimizer is not None else []), *model.metrics_variables]:
        seen.setdefault(id(v), v)
    return list(seen.values())


def join_jax_job(model: Any, collective: Any, host: str, timeout: float, on_gpu: bool) -> None:
    """Join the workers' ``jax.distributed`` job, keeping the model's state (read out, backend cleared, put back).

    Layers' plain JAX arrays (an adapted Normalization's mean) are put back too."""
    import jax
    import jax.numpy as jnp
    from jax.extend.backend import clear_backends

    variables = model_variables(model)
    values = [np.asarray(v.value) for v in variables]
    layers = list(model._flatten_layers(include_self=True))
    arrays = [(layer, name, np.asarray(val)) for layer in layers for name, val in list(vars(layer).items())
              if isinstance(val, jax.Array)]
    address = coordinator_address(collective, host)
    # The old client goes before the new one starts: on a GPU it holds most of the memory (preallocation).
    for v in variables:
        v._value = None
    for layer, name, _ in arrays:
        setattr(layer, name, None)
    gc.collect()
    clear_backends()
    if not on_gpu:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    seconds = max(10, int(timeout))
    # The coordinator listens where the store does (loopback for local workers), not on every interface.
    jax.distributed.initialize(address, collective.world_size, collective.rank, initialization_timeout=seconds,
                               heartbeat_timeout_seconds=seconds, shutdown_timeout_seconds=seconds,
                               coordinator_bind_address=address if collective.rank == 0 else None)
    if jax.local_device_count() != 1:
        raise RuntimeError(f"nbdist's JAX job needs one device per worker process, and this worker sees "
                           f"{jax.local_device_count()}; give each worker one GPU (CUDA_VISIBLE_DEVICES) or train "
                           "with --engine gloo (allreduce) or device_sum='never' (averaging)")
    for v, value in zip(variables, values):
        v.assign(value)
    for layer, name, value in arrays:
        setattr(layer, name, jnp.asarray(value))
    log.info("worker %d joined the JAX job at %s (%d devices)", collective.rank, address, len(jax.devices()))


def batch_rows(data: Any) -> int:
    """The rows of a batch: the first dimension of its first array."""
    import jax

    leaves = [leaf for leaf in jax.tree_util.tree_leaves(data) if np.ndim(leaf) > 0]
    if not leaves:
        raise ValueError("a training batch with no arrays")
    return int(np.shape(leaves[0])[0])


def weighted_sums(arrays: Sequence[Any], weight: Any, axis: str, fused: bool) -> tuple[list[Any], Any]:
    """(sum_w n_w a_w for each array, float32 in its shape; sum_w n_w) over the mesh axis, inside ``shard_map``.

    ``fused`` (CPUs): one collective, the scaled arrays and the weight in one float32 bucket, as each
    collective over Gloo costs a round trip. Unfused (GPUs): one ``psum`` per array and one for the weight, so
    that XLA can start each gradient's sum as soon as the backward pass has made it, while the rest of the
    backward pass runs (its all-reduce combiner merges the small ones); a bucket would wait for the last
    gradient. The same numbers either way."""
    import jax
    import jax.numpy as jnp

    weight = jnp.asarray(weight, jnp.float32)

    def scaled(a: Any) -> Any:  # a worker with no rows adds exact zeros (0 * inf would spread a NaN)
        return jnp.where(weight > 0, jnp.asarray(a, jnp.float32) * weight, 0.0)

    if not fused:
        return [jax.lax.psum(scaled(a), axis) for a in arrays], jax.lax.psum(weight, axis)
    bucket = jnp.concatenate([jnp.ravel(scaled(a)) for a in arrays] + [jnp.reshape(weight, (1,))])
    summed = jax.lax.psum(bucket, axis)
    sums, start = [], 0
    for a in arrays:
        size = int(np.prod(a.shape))
        sums.append(summed[start:start + size].reshape(a.shape))
        start += size
    return sums, summed[-1]


def weighted_psum(grads: Sequence[Any], rows: int, axis: str, fused: bool = True) -> list[Any]:
    """sum_w (n_w / N) g_w over the mesh axis (inside ``shard_map``): each worker's gradients weighted by its
    rows this step, as the host path weights them (sum_w n_w g_w, then / N); handed back in each gradient's
    dtype, None where a gradient is None."""
    sums, total = weighted_sums([g for g in grads if g is not None], rows, axis, fused)
    scale = 1.0 / total
    it = iter(sums)
    return [None if g is None else (next(it) * scale).astype(g.dtype) for g in grads]


def weighted_mean(values: Sequence[Any], samples: Any, axis: str, fused: bool) -> tuple[list[Any], Any]:
    """(sum_w n_w v_w / sum_w n_w for each value, in its dtype; sum_w n_w) over the mesh axis: an averaging
    round (inside ``shard_map``). Where no worker trained since the last round (the sum is 0) every value is
    kept as it is."""
    import jax.numpy as jnp

    sums, total = weighted_sums(values, samples, axis, fused)
    scale = 1.0 / jnp.maximum(total, 1.0)
    return [jnp.where(total > 0, s * scale, v).astype(v.dtype) for s, v in zip(sums, values)], total


def fused_sum() -> bool:
    """One bucket per step on CPUs (Gloo), one sum per gradient on GPUs (``weighted_psum``)."""
    import jax

    return jax.devices()[0].platform != "gpu"


def workers_mesh(axis: str) -> tuple[Any, Any]:
    """(the replicated sharding over one device per worker process, this process's device)."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    return NamedSharding(Mesh(np.array(jax.devices()), (axis,)), PartitionSpec()), jax.local_devices()[0]


def mesh_step(body: Any, mesh: Any) -> Any:
    """``body(state, inputs)`` jitted over the mesh, both replicated (``P()``) in and out, ``check_vma`` off (each
    process's shard is its own), the state donated."""
    import jax
    from jax.sharding import PartitionSpec

    spec = PartitionSpec()
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, spec), check_vma=False),
                   donate_argnums=0)


def on_mesh(tree: Any, device: Any, replicated: Any) -> Any:
    """This process's arrays as the global mesh's (its shard is its own; no copy where already on device)."""
    import jax

    def put(leaf: Any) -> Any:
        if isinstance(leaf, jax.Array) and leaf.sharding == replicated:  # the last step's state
            return leaf
        if isinstance(leaf, jax.Array) and leaf.committed and leaf.devices() == {device}:
            local = leaf  # on this device already (a variable's value): no copy, no dispatch
        else:
            local = jax.device_put(np.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf, device)
        return jax.make_array_from_single_device_arrays(local.shape, replicated, [local])

    return jax.tree_util.tree_map(put, tree)


def local_part(tree: Any) -> Any:
    """This process's shard of each global array (its own values)."""
    import jax

    return jax.tree_util.tree_map(lambda a: a.addressable_data(0) if isinstance(a, jax.Array) else a, tree)


class JaxDeviceSum:
    """Keras' JAX train step over the global mesh of one device per worker process, the gradients summed inside it
    (installed on one model): each process computes its own batch's gradients and the wrapped ``stateless_apply``
    sums them (``weighted_psum``) before the update, so nothing leaves the device during a step and the CPU test
    runs the GPU's code path. The state and the batch go in "replicated" (``P()``) with ``check_vma`` off: each
    process's shard is its own batch, metrics and statistics; only the summed gradients, and so the weights and
    the optimizer's state, are the same everywhere. JAX's CPU collectives have had wrong sums and hangs
    (DESIGN.md 9): the sums are tested against numpy.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.replicated, self.device = workers_mesh(AXIS)
        self.mesh = self.replicated.mesh
        self.rows = 0  # the traced batch's rows, read by the wrapped stateless_apply while it traces
        self._last_state: Any = None  # the state the last step returned (on the mesh)
        self.steps = 0
        self.fused = fused_sum()

    def install(self) -> None:
        """Wrap the optimizer's ``stateless_apply`` and make Keras' train function this mesh's step."""

        model, optimizer = self.model, self.model.optimizer
        original = optimizer.stateless_apply

        def stateless_apply(optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
            return original(optimizer_variables, weighted_psum(list(grads), self.rows, AXIS, self.fused),
                            trainable_variables)

        optimizer.stateless_apply = stateless_apply

        def body(state: Any, data: Any) -> Any:
            self.rows = batch_rows(data)
            return model.train_step(state, data)

        step = mesh_step(body, self.mesh)

        def train_step(state: Any, data: Any) -> Any:
            self.steps += 1
            # Keras hands the last step's state back as it got it: already on the mesh, nothing to look at
            # (a per-leaf check cost ~0.1 ms a step for a 3-layer MLP's 28 arrays).
            mesh_state = state if state is self._last_state else on_mesh(state, self.device, self.replicated)
            logs, self._last_state = step(mesh_state, on_mesh(data, self.device, self.replicated))
            return local_part(logs), self._last_state  # on the mesh until Keras syncs its variables

        def make_train_function(force: bool = False) -> None:
            if model.train_function is None or force:
                model.train_function = model._make_function(train_step)

        original_sync = model.jax_state_sync

        def jax_state_sync() -> None:
            """The variables get this process's arrays (evaluation and callbacks run locally)."""
            if getattr(model, "_jax_state", None) and not model._jax_state_synced:
                model._jax_state = local_part(model._jax_state)
            original_sync()

        model.make_train_function = make_train_function
        model.jax_state_sync = jax_state_sync
        model.train_function = None


class JaxDeviceAverage(Averager):
    """The averaging strategy's round over the workers' JAX job: sum_w n_w v_w / sum_w n_w of the variables
    where they are (XLA's all-reduce inside one jitted ``shard_map``: NCCL on GPUs, Gloo on CPUs), assigned back.
    The variables hold the running fit's state when a round starts (``AveragingCallback`` syncs it) and Keras'
    next step reads them back, so no variable leaves the device and nothing waits for it: the summed count
    stays on the device (a round where no worker trained keeps every variable as it is). So ``seconds`` counts
    the round's dispatch only; its device time falls in the next step's. The round's inputs are donated: the
    averaged variables' old arrays are dropped as the averages are made (no second copy of the state)."""

    def __init__(self, model: Any, variables: Sequence[Any]) -> None:
        """``variables``: the ones averaged, of ``model``."""
        import jax

        self.variables = list(variables)
        self.replicated, self.device = workers_mesh(AXIS)
        # Keras' train step is compiled for its state's placement, and the rounds' results are committed to the
        # device: so is every variable of the fit from the start, else the first step after a round compiles
        # the step again (the metrics' reset at each epoch's start still makes one more placement, once).
        for v in model_variables(model):
            if v.value is not None:
                v.assign(jax.device_put(v.value, self.device))
        fused = fused_sum()

        def body(values: list[Any], samples: Any) -> tuple[list[Any], Any]:
            return weighted_mean(values, samples, AXIS, fused)

        self._mean = mesh_step(body, self.replicated.mesh)

    def _round(self, samples: int) -> Any:
        """The summed count comes back as a device scalar (the other averagers' int; reading it waits for the round)."""
        values = on_mesh([v.value for v in self.variables], self.device, self.replicated)
        averaged, total = self._mean(values, on_mesh(np.float32(samples), self.device, self.replicated))
        for v, value in zip(self.variables, local_part(averaged)):
            v.assign(value)
        return local_part(total)
