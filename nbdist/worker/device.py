"""Which device this worker trains on, and the facts every worker shares for the engine's choice.

A worker sees at most one GPU (CUDA_VISIBLE_DEVICES per rank, machine/placement.py), so its GPU is its device 0;
the report names it by the host's numbering and product name. ``engine_plan`` sums every worker's GPU and
machine once, so all hand the same facts to machine/engines.py's ``select`` and choose alike.
"""
from __future__ import annotations

import os
import socket
import zlib
from typing import Any

import numpy as np

from ..machine.placement import describe_device


def _host_index(default: object = "0") -> str:
    """The GPU's id on the host: the first in CUDA_VISIBLE_DEVICES (the worker's device 0), else ``default``."""
    ids = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ids[0] if ids else str(default)


def training_device() -> str:
    """"GPU 3 (NVIDIA H200)" or "CPU": where Keras' backend places this worker's variables."""
    import keras

    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        if torch.cuda.is_available():
            return describe_device("gpu", _host_index(), torch.cuda.get_device_name(0))
        return "CPU"
    if backend == "jax":
        import jax

        device = jax.devices()[0]
        return describe_device(device.platform, _host_index(), getattr(device, "device_kind", None))
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "CPU"
    details = tf.config.experimental.get_device_details(gpus[0])
    return describe_device("gpu", _host_index(), details.get("device_name"))


def gpu_identity() -> str:
    """This worker's GPU as one string, equal for two workers on the same device ("" without one): its host
    and PCI bus. Read through torch, the engine library, which both TensorFlow and torch workers load; on Keras'
    JAX backend through JAX, so that a JAX worker does not open a CUDA context of torch's beside its own."""
    import keras

    if keras.backend.backend() == "jax":
        return _jax_gpu_identity()
    try:
        import torch
    except ImportError:
        return ""
    if not torch.cuda.is_available():
        return ""
    props = torch.cuda.get_device_properties(0)
    bus = getattr(props, "pci_bus_id", None)
    uuid = getattr(props, "uuid", None)
    return f"{socket.gethostname()}/{bus if bus is not None else uuid if uuid is not None else props.name}"


def _jax_gpu_identity() -> str:
    """A JAX worker's GPU: its host and the GPU's id on the host (JAX gives no PCI bus). Each worker sees one GPU
    (CUDA_VISIBLE_DEVICES per rank); with none set, every worker's device 0 is the same GPU, which this says."""
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu":
        return ""
    return f"{socket.gethostname()}/{_host_index(device.local_hardware_id)}"


def worker_facts(collective: Any, mine: str | None = None) -> tuple[list[int], bool]:
    """Every worker's GPU by rank as an integer identity (0: none; CRC-32s of ``gpu_identity``, exact in a
    float64, equal for two workers on one device) and whether all run on one machine (one kernel's boot id),
    summed once so that every worker makes the same engine choice."""
    from ..strategies.shm_files import boot_id

    identity = gpu_identity() if mine is None else mine
    world, rank = collective.world_size, collective.rank
    flags = np.zeros(2 * world, dtype=np.float64)
    flags[rank] = float(zlib.crc32(identity.encode()) | 1) if identity else 0.0
    flags[world + rank] = float(zlib.crc32(boot_id().encode()) | 1)
    collective.allreduce_sum(flags)
    return [int(f) for f in flags[:world]], len({int(f) for f in flags[world:]}) == 1


def engine_plan(collective: Any, train: Any, strategy: str, bucket_bytes: int,
                equal_steps: bool | None = None) -> Any:
    """The engine that sums this run (machine/engines.py ``select``), from facts every worker shares and the
    job's typed choices (TrainSettings); refused in one sentence (NbdistError) where it cannot be met."""
    import keras

    from ..config import engine_choice
    from ..machine.engines import Facts, Plan, gpu_facts, select
    from ..strategies.host_collective import HostCollective

    if collective.world_size < 2:
        return Plan("none")
    gpus, one_host = worker_facts(collective)
    kind, obstacle = gpu_facts(gpus)
    inner = getattr(collective, "inner", collective)
    facts = Facts(keras.backend.backend(), strategy, collective.world_size, kind, obstacle, one_host,
                  int(bucket_bytes), equal_steps, has_torch=not isinstance(inner, HostCollective))
    return select(facts, engine_choice(train))


def device_averager(collective: Any, model: Any, variables: list[Any], plan: Any) -> Any:
    """The averaging strategy's rounds on the tensors where they are, as ``plan`` says (``engine_plan``):
    ``JaxDeviceAverage`` inside the workers' JAX job (joined keeping the model's state), ``TorchDeviceAverage`` in
    torch's device buckets (NCCL on GPUs, Gloo on CPU tensors with device_sum="always"; TensorFlow's variables by
    DLPack); None: the host's ``WeightedAverager``."""
    import keras

    if plan.engine == "jax":
        import jax

        from ..strategies import jax_device_sum

        jax_device_sum.join_jax_job(model, collective, collective.store.host, collective.timeout,
                                    jax.default_backend() == "gpu")
        return jax_device_sum.JaxDeviceAverage(model, variables)
    if plan.engine != "torch" or not plan.device:
        return None
    from ..strategies.device_sum import open_device_average

    return open_device_average(variables, plan.mode, plan.bucket_bytes, collective.timeout, keras.backend.backend())
