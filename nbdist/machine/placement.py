"""Which device, cores and threads each worker uses (pure logic, unit-tested without GPUs).

One GPU per worker (CUDA_VISIBLE_DEVICES per rank, round-robin beyond the GPUs), contiguous cores per local
worker, and the sentences a run says about them. Which engine sums is machine/engines.py's.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def gpu_for_local_rank(local_rank: int, gpu_count: int) -> int | None:
    """The GPU index (among the visible ones) a worker pins, or None on a CPU-only host.

    One GPU per worker; with more workers than GPUs on a host they share round-robin
    rather than fail, which is slower but still correct.
    """
    if local_rank < 0:
        raise ValueError("local_rank must be >= 0")
    if gpu_count <= 0:
        return None
    return local_rank % gpu_count


def visible_devices(parent_visible: str | None) -> list[str] | None:
    """The GPU ids the parent may use: its CUDA_VISIBLE_DEVICES list, or None for 'all of them'."""
    if parent_visible is None:
        return None
    return [d.strip() for d in parent_visible.split(",") if d.strip() and d.strip() != "-1"]


def cuda_visible_devices_for_rank(local_rank: int, gpu_count: int, parent_visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for the worker with ``local_rank``: exactly one GPU, or none ("").

    ``gpu_count`` is the number of GPUs on the host; a parent restriction
    (``CUDA_VISIBLE_DEVICES="2,3"``) is honoured, so worker 1 then gets "3".
    """
    allowed = visible_devices(parent_visible)
    ids = allowed if allowed is not None else [str(i) for i in range(max(0, gpu_count))]
    index = gpu_for_local_rank(local_rank, len(ids))
    return "" if index is None else ids[index]


def count_host_gpus(proc_dir: str = "/proc/driver/nvidia/gpus") -> int:
    """NVIDIA GPUs on this host as the driver lists them (0 when there is no NVIDIA driver)."""
    path = Path(proc_dir)
    try:
        return sum(1 for p in path.iterdir() if p.is_dir())
    except OSError:
        return 0


def local_gpu_env(rank: int, environ: dict[str, str] | None = None, gpu_count: int | None = None,
                  world: int = 1) -> dict[str, str]:
    """Environment entries that pin a local worker to its GPU (the local backend's per-rank env), with JAX's
    memory settings when ``world`` local workers share the GPUs (``jax_memory_env``)."""
    environ = os.environ if environ is None else environ
    count = count_host_gpus() if gpu_count is None else gpu_count
    parent = environ.get("CUDA_VISIBLE_DEVICES")
    env = {"CUDA_VISIBLE_DEVICES": cuda_visible_devices_for_rank(rank, count, parent)}
    return {**env, **jax_memory_env(world, visible_gpu_count(count, parent), environ)}


def visible_gpu_count(host_gpus: int, parent_visible: str | None) -> int:
    """The GPUs this process may hand to workers: the host's, or as many as CUDA_VISIBLE_DEVICES names."""
    allowed = visible_devices(parent_visible)
    if host_gpus <= 0:
        return 0
    return host_gpus if allowed is None else len(allowed)


def workers_per_gpu(local_world: int, gpus: int) -> int:
    """The most local workers any one GPU carries (round-robin, ``gpu_for_local_rank``); 0 without GPUs."""
    return 0 if gpus <= 0 else -(-max(0, local_world) // gpus)


def jax_memory_env(local_world: int, gpus: int, environ: dict[str, str] | os._Environ[str] | None = None
                   ) -> dict[str, str]:
    """JAX's memory settings for workers sharing a GPU: each JAX process preallocates 75% of its GPU's memory
    at its first operation, so two on one GPU fail ("Failed to get configs") or fight. Sharing, they allocate
    as they go (XLA_PYTHON_CLIENT_PREALLOCATE=false); a setting of the user's stands."""
    environ = {} if environ is None else environ
    if workers_per_gpu(local_world, gpus) <= 1 or any(
            k in environ for k in ("XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                   "XLA_PYTHON_CLIENT_ALLOCATOR")):
        return {}
    return {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def default_worker_count(gpus: int, cpu_default: int) -> tuple[int, str | None]:
    """Workers when ``--workers`` is not given: one per visible GPU where there are GPUs (with the sentence
    the run's first line says), else the CPU default."""
    if gpus <= 0:
        return cpu_default, None
    return gpus, (f"{gpus} worker{'s' if gpus > 1 else ''}, one per visible GPU "
                  "(--workers N to choose; workers beyond the GPUs share them round-robin).")


def usable_cores() -> set[int] | None:
    """The cores this process may run on, or None where the OS cannot say (no sched_getaffinity)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def threads_per_worker(world: int) -> int:
    """Each of ``world`` workers' share of this process's cores (at least 1): their thread budget."""
    cores = usable_cores()
    return max(1, (len(cores) if cores else os.cpu_count() or 1) // world)


def interop_threads(threads: int) -> int:
    """TensorFlow's inter-op pool for a worker with ``threads`` cores: one or two, never more than it has."""
    return max(1, min(2, threads))


def core_slices(cores: list[int] | set[int] | tuple[int, ...], world: int, threads: int) -> list[set[int]] | None:
    """Each local worker's own contiguous cores (``threads`` each), like ``mpirun --bind-to core``.

    ``cores`` are the ones this process may use (``os.sched_getaffinity(0)``). Pinned, a worker
    keeps its caches and never has its one busy thread moved onto a peer's core by the
    scheduler. More workers than cores: None (no pinning; sharing is the scheduler's job).
    A slice never exceeds an even share of the cores, whatever ``threads`` says.
    """
    if world < 1 or threads < 1:
        raise ValueError("world and threads must be >= 1")
    ordered = sorted(set(cores))
    if world > len(ordered):
        return None
    per = min(threads, len(ordered) // world)
    return [set(ordered[r * per:(r + 1) * per]) for r in range(world)]


def shared_core_slices(cores: list[int] | set[int] | tuple[int, ...], world: int, threads: int, share: int = 1,
                       slot: int = 0) -> list[set[int]] | None:
    """``core_slices`` for the ``world`` workers of one of ``share`` runs using the machine at once (a
    search's parallel trials), the one numbered ``slot``: its workers' cores are none of the others'.
    None when the runs' workers together outnumber the cores (the scheduler shares them)."""
    if not 0 <= slot < share:
        raise ValueError("slot must be in 0 .. share - 1")
    slices = core_slices(cores, world * share, threads)
    return None if slices is None else slices[slot * world:(slot + 1) * world]


# Internal: the notebook tells a fork server it starts what to import ("device-free": nothing that picks a
# GPU); not a user setting (those are TrainConfig's).
WARM_IMPORTS = "NBDIST_WARM_IMPORTS"


def warm_server_env(gpus: int) -> dict[str, str]:
    """What a fork server of local workers may import ahead of its jobs (backends/warm.py): everything on a
    CPU machine; with GPUs only what initialises no device ("device-free": torch and nbdist, not Keras).

    A forked child inherits no usable CUDA state, and CUDA reads CUDA_VISIBLE_DEVICES once, when it
    initialises; Keras' torch backend calls torch.cuda.is_available() as it is imported (which initialises
    the driver), so a server that imported Keras would fork workers without their GPU or all on one. Each
    worker imports Keras itself, after its job has set its GPU."""
    return {WARM_IMPORTS: "device-free"} if gpus > 0 else {}


def describe_device(platform: str, index: str | int | None = None, name: str | None = None) -> str:
    """How a report names the device a worker trained on: "GPU 1 (NVIDIA H200)" or "CPU".

    ``index``: the GPU's id as the host numbers it (the worker's CUDA_VISIBLE_DEVICES), not its own 0."""
    if platform.lower() in ("cpu", ""):
        return "CPU"
    where = "GPU" if index is None or index == "" else f"GPU {index}"
    return f"{where} ({name})" if name else where


# Internal: set in a worker's environment where the run asked for GPUs (--gpus); not a user setting.
GPUS_ASKED = "NBDIST_GPUS_ASKED"


def gpu_missing_notice(engine: str | None, device: str, gpus_asked: bool = False) -> str | None:
    """The sentence for a worker asked to use GPUs (``--engine nccl``, a container's ``--gpus``) that trains on
    the CPU, else None."""
    if device != "CPU" or not (engine == "nccl" or gpus_asked):
        return None
    asked = "--engine nccl" if engine == "nccl" else "--gpus"
    return (f"{asked} asks for GPUs but this worker sees none (a container engine without the NVIDIA runtime, "
            "an executor without GPU resources, or CUDA_VISIBLE_DEVICES empty): it trains on the CPU.")


def spark_task_visible_devices(addresses: list[str] | tuple[str, ...] | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for the worker a Spark task hosts, from the GPUs Spark assigned the task.

    ``addresses`` are the task's ``resources()["gpu"].addresses`` (None: Spark schedules no GPUs,
    so the executor's own setting stands). One GPU per worker, as allreduce pins: a task given
    several GPUs hands its worker the first; given none, the worker sees none ("").
    NOT VERIFIED ON A GPU (there is none here).
    """
    if addresses is None:
        return None
    ids = [str(a).strip() for a in addresses if str(a).strip()]
    return ids[0] if ids else ""



def meeting(backend: str, world_size: int, strategy: str, has_torch: bool | None = None) -> str:
    """How a training job's workers meet and sum: "host" when every worker runs on this machine (the local
    backend) and torch is not installed here (a directory and shared memory, strategies/host_collective.py);
    else "torch" (a TCPStore and a Gloo group, NCCL on GPUs). Async and one worker use neither."""
    if has_torch is None:
        import importlib.util

        has_torch = importlib.util.find_spec("torch") is not None
    if world_size > 1 and backend == "local" and strategy != "async" and not has_torch:
        return "host"
    return "torch"


def collectives_missing(world_size: int, strategy: str, engine: str | None,
                        has_module: Any = None) -> str | None:
    """The one sentence a run of local workers gets, before any worker starts, when the engine it asks for
    needs a package this Python lacks; None when they have what they need.

    Without torch, several synchronous workers of this machine meet and sum through shared memory
    (``meeting``); an engine named with ``--engine`` (Gloo, NCCL, JAX's job) is torch.distributed's
    or meets through its store. ``--strategy async`` and one worker use none."""
    import importlib.util

    has = has_module or (lambda name: importlib.util.find_spec(name) is not None)
    if world_size < 2 or strategy == "async" or engine is None or has("torch"):
        return None
    return (f"--engine {engine} runs over torch.distributed, and torch is not installed here: "
            "pip install 'nbdist[torch]' (a CPU build is enough without GPUs), or drop --engine: "
            "workers of this machine then sum through shared memory.")
