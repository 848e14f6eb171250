"""Which device this worker trains on, read from the framework that trains (the worker's own side).

A worker sees at most one GPU (CUDA_VISIBLE_DEVICES per rank, machine/placement.py), so its GPU is its device 0;
the report names it by the host's numbering (the id in CUDA_VISIBLE_DEVICES) and by its product name.
NOT VERIFIED ON A GPU for TensorFlow (no TensorFlow on the GPU machines); torch and JAX are read as the
GPU check reads them (benchmarks/gpu_check).
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


def worker_gpus(collective: Any, mine: str | None = None) -> list[int]:
    """Every worker's GPU, by rank, as an integer identity (0: none), summed once so that every worker makes
    the same engine choice (placement.choose_torch_engine). Identities are CRC-32s of ``gpu_identity``:
    exact in a float64, and two workers on one device give the same."""
    identity = gpu_identity() if mine is None else mine
    flags = np.zeros(collective.world_size, dtype=np.float64)
    flags[collective.rank] = float(zlib.crc32(identity.encode()) | 1) if identity else 0.0
    collective.allreduce_sum(flags)
    return [int(f) for f in flags]


# Per Keras backend, the variable that runs the device's code over Gloo on CPUs ("1", tests) or keeps the
# averaging strategy's rounds in host memory ("0": the way back should the device's rounds misbehave on some
# GPU; allreduce has --engine gloo for that).
DEVICE_SUM_VARIABLES = {"torch": "NBDIST_TORCH_DEVICE_SUM", "tensorflow": "NBDIST_TF_DEVICE_SUM",
                        "jax": "NBDIST_JAX_DEVICE_SUM"}


def host_rounds_asked(backend: str) -> bool:
    """Whether the user set this backend's device-sum variable to 0: averaging rounds through host memory."""
    return os.environ.get(DEVICE_SUM_VARIABLES.get(backend, ""), "") == "0"


def device_averager(collective: Any, variables: list[Any]) -> Any:
    """The averaging strategy's rounds on the GPUs where every worker has a GPU of its own: ``TorchDeviceAverage``
    on Keras' torch backend, ``TFDeviceAverage`` on TensorFlow (or, NBDIST_TORCH_DEVICE_SUM=1 and
    NBDIST_TF_DEVICE_SUM=1 respectively, the same code over Gloo on CPU tensors); None: the host's
    ``WeightedAverager``. Every worker of more than one decides from the same sum."""
    import keras

    backend = keras.backend.backend()
    if collective.world_size == 1 or backend not in ("torch", "tensorflow") or host_rounds_asked(backend):
        return None
    from ..machine.placement import choose_torch_engine
    from ..strategies.backend_grads import device_sum_forced
    from ..strategies.device_sum import TorchDeviceAverage, configured_bucket_bytes, device_group, engine_device
    from ..strategies.tf_device_sum import TFDeviceAverage, tf_device_sum_forced

    engine, _ = choose_torch_engine(None, worker_gpus(collective))  # the one line is the allreduce's
    forced = tf_device_sum_forced() if backend == "tensorflow" else device_sum_forced()
    if engine != "nccl" and not forced:
        return None
    if backend == "tensorflow":
        return TFDeviceAverage(variables, engine, configured_bucket_bytes(), collective.timeout)
    return TorchDeviceAverage(variables, engine_device(engine), device_group(engine, collective.timeout),
                              configured_bucket_bytes())


def jax_device_averager(collective: Any, model: Any, variables: list[Any], timeout: float) -> Any:
    """The averaging strategy's rounds inside the workers' JAX job (``JaxDeviceAverage``: XLA's all-reduce on the
    devices) where Keras runs on JAX and every worker has a GPU of its own (or, NBDIST_JAX_DEVICE_SUM=1, the same
    code over Gloo on CPUs); None: the host's ``WeightedAverager``. Joining the job keeps the model's state
    (``join_jax_job``). Every worker of more than one decides from the same sum."""
    if collective.world_size == 1 or host_rounds_asked("jax"):
        return None
    from ..machine.placement import choose_jax_engine
    from ..strategies import jax_device_sum

    # Every round runs one program on every worker (the rounds per epoch are padded to the same count), so
    # unequal shares do not matter here as they do for the allreduce's step.
    gpus = worker_gpus(collective)
    engine, _ = choose_jax_engine("jax" if jax_device_sum.jax_device_sum_forced() else None, True, gpus)
    if engine != "jax":
        return None
    jax_device_sum.join_jax_job(model, collective, collective.store.host, timeout, bool(gpus[collective.rank]))
    return jax_device_sum.JaxDeviceAverage(model, variables)
