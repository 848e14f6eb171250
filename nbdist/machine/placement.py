"""Which device and which collective engine each allreduce worker uses (pure logic).

Kept free of TensorFlow, torch and processes so it can be unit-tested on a
machine without GPUs. NOT VERIFIED ON A GPU: nbdist was developed on a CPU-only
machine, so the decisions below are tested, but the NCCL and Horovod engines
they select have never run (see strategies/allreduce_hook.py).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import NbdistError

ENGINES = ("gloo", "nccl", "horovod", "jax")


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


def choose_engine(requested: str | None, has_gpu: bool, horovod_error: str | None) -> tuple[str, str | None]:
    """Resolve ``--engine`` on a worker: (engine to use, warning sentence or None).

    ``horovod_error`` is why ``import horovod.tensorflow`` failed (None: it works).
    Horovod is optional: when it cannot be imported we say so and use the default.
    NCCL needs a GPU, so asking for it on a CPU worker is an error with the fix.
    """
    default = "nccl" if has_gpu else "gloo"
    if requested is None:
        return default, None
    if requested not in ENGINES:
        raise NbdistError(f"unknown engine {requested!r}; use one of: {', '.join(ENGINES)}.")
    if requested == "jax":
        raise NbdistError(JAX_ONLY)
    if requested == "nccl" and not has_gpu:
        raise NbdistError("--engine nccl needs a GPU on every worker and this worker has none; "
                          "use --engine gloo (the default on CPU).")
    if requested == "horovod" and horovod_error is not None:
        return default, (f"--engine horovod: Horovod cannot be imported on this worker ({horovod_error}), "
                         f"so nbdist uses its default engine, {default}.")
    return requested, None


def nccl_obstacle(gpus: Sequence[object]) -> str | None:
    """Why NCCL cannot sum for these workers, as a clause (None: it can).

    ``gpus``: each worker's GPU, by rank, as an identity (its host and device, ``worker/device.py``), or a
    false value for none. NCCL needs a GPU on every worker, and refuses two ranks on one device
    ("invalid usage"), so every worker must have its own.
    """
    lacking = [str(rank) for rank, gpu in enumerate(gpus) if not gpu]
    if not gpus or lacking:
        return (f"worker {lacking[0]} has no GPU" if len(lacking) == 1
                else f"workers {', '.join(lacking)} have no GPU") if lacking else "there are no workers"
    first: dict[object, int] = {}
    for rank, gpu in enumerate(gpus):
        if gpu in first:
            return f"workers {first[gpu]} and {rank} share one GPU"
        first[gpu] = rank
    return None


def sharing_notice(obstacle: str) -> str:
    """The one line a run on GPUs says when it sums over Gloo instead of NCCL, and what that costs."""
    return (f"{obstacle[0].upper()}{obstacle[1:]}, and NCCL needs a GPU of its own for every worker: the "
            "gradients are summed over Gloo, through host memory (each step copies them off the GPU and back).")


def choose_torch_engine(requested: str | None, gpus: Sequence[object]) -> tuple[str, str | None]:
    """Resolve ``--engine`` under allreduce on Keras' torch backend: (engine to use, warning sentence or None).

    ``gpus``: each worker's GPU identity by rank, or a false value for none (summed over the workers first,
    so every worker makes the same choice: an NCCL group needs all of them). NCCL when every worker has a GPU
    of its own (``nccl_obstacle``), else Gloo, said in one line where some have GPUs; ``--engine nccl``
    otherwise is refused with the fix. Horovod is not driven on torch (docs/backends.md): said
    once, and the default engine sums.
    """
    obstacle = nccl_obstacle(gpus)
    every = obstacle is None
    default = "nccl" if every else "gloo"
    if requested is None:
        return default, (sharing_notice(obstacle) if obstacle and any(gpus) else None)
    if requested not in ENGINES:
        raise NbdistError(f"unknown engine {requested!r}; use one of: {', '.join(ENGINES)}.")
    if requested == "jax":
        raise NbdistError(JAX_ONLY)
    if requested == "nccl" and not every:
        raise NbdistError(f"--engine nccl needs a GPU of its own for every worker and {obstacle}; use --engine "
                          "gloo (the default then), or give each worker its own GPU (--workers at most the GPUs).")
    if requested == "horovod":
        return default, ("--engine horovod is not available on Keras' torch backend: Horovod 0.28.1's PyTorch "
                         "extension does not build against torch 2.13 as released (it compiles as C++14 and "
                         "torch's headers need C++17), and nbdist does not drive it there; the gradients are "
                         f"summed over {'NCCL' if every else 'Gloo'}.")
    return requested, None


JAX_ONLY = ("--engine jax sums with JAX's own collectives and needs Keras' jax backend (KERAS_BACKEND=jax); "
            "use --engine gloo or nccl on this backend.")


def unequal_rows_notice(requested: str | None) -> str:
    """Why JAX's device sum gives way to the host path when the workers' rows per step differ (every process
    runs one program): worded for ``--engine jax`` asked by name, or for the default on GPUs (``None``)."""
    if requested == "jax":
        return ("--engine jax needs the same rows per step on every worker (rows divisible by the workers, array "
                "data); these shares differ, so the gradients are summed over Gloo.")
    return ("Every worker has a GPU of its own, but JAX's sum on the GPUs needs the same rows per step on every "
            "worker (rows divisible by the workers, array data) and these shares differ: the gradients are summed "
            "over Gloo, through host memory (each step copies them off the GPU and back).")


def choose_jax_engine(requested: str | None, equal_steps: bool | None = None,
                      gpus: Sequence[object] = ()) -> tuple[str, str | None]:
    """Resolve ``--engine`` under allreduce on Keras' JAX backend: (engine to use, warning sentence or None).

    ``jax``: the sum inside the jitted step over JAX's collectives (strategies/jax_device_sum.py, NCCL inside
    XLA on GPUs). It needs every step's batch to have the same rows on every worker (``equal_steps``; None: not
    known yet), as every process runs one program, and, where any worker has a GPU (``gpus``, by rank, as for
    ``nccl_obstacle``), a GPU of its own for every worker. ``gloo``: a host call in the step, the gradients
    summed in host memory. The default is ``jax`` where every worker has a GPU of its own (the host call
    would copy every gradient off the GPU and back each step) and ``gloo`` on CPUs, where the host path
    measured faster (docs/gpus.md); a condition the default cannot meet is said once, with its cost, and
    Gloo sums. NCCL and Horovod are not driven on JAX: said once, and Gloo sums."""
    if requested == "gloo":
        return "gloo", None
    if requested is not None and requested not in ENGINES:
        raise NbdistError(f"unknown engine {requested!r}; use one of: {', '.join(ENGINES)}.")
    obstacle = nccl_obstacle(gpus) if any(gpus) else None
    if requested is None:
        if not any(gpus):
            return "gloo", None
        if obstacle:
            return "gloo", sharing_notice(obstacle)
        return ("gloo", unequal_rows_notice(None)) if equal_steps is False else ("jax", None)
    if requested == "jax":
        if obstacle:
            return "gloo", (f"--engine jax sums over NCCL inside XLA on GPUs, which needs a GPU of its own for every "
                            f"worker, and {obstacle}: the gradients are summed over Gloo, through host memory.")
        return ("gloo", unequal_rows_notice("jax")) if equal_steps is False else ("jax", None)
    why = ("Horovod 0.28.1, its last release, has no JAX support" if requested == "horovod" else
           "nbdist does not drive NCCL from JAX by itself; --engine jax sums with JAX's own collectives, NCCL "
           "inside XLA on GPUs")
    return "gloo", f"--engine {requested} is not available on Keras' jax backend: {why}; the gradients are summed " \
        "over Gloo."


def nccl_or_gloo(engine: str, warning: str | None, requested: str | None,
                 gpus: Sequence[object]) -> tuple[str, str | None]:
    """TensorFlow's engine (``choose_engine``, decided by each worker alone) checked against every worker's
    GPU: NCCL stands only where each has its own (``nccl_obstacle``); otherwise Gloo with its one line, or,
    when NCCL was asked for by name, the refusal with the fix."""
    obstacle = None if engine != "nccl" else nccl_obstacle(gpus)
    if obstacle is None:
        return engine, warning
    if requested == "nccl":
        raise NbdistError(f"--engine nccl needs a GPU of its own for every worker and {obstacle}; use --engine "
                          "gloo (the default then), or give each worker its own GPU (--workers at most the GPUs).")
    return "gloo", sharing_notice(obstacle)


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


GPUS_ASKED = "NBDIST_GPUS_ASKED"  # set in a worker's environment where the run asked for GPUs (--gpus)


def gpu_missing_notice(engine: str | None, device: str, gpus_asked: bool = False) -> str | None:
    """The sentence for a worker asked to use GPUs (``--engine nccl``, a container's ``--gpus``) that trains on
    the CPU, else None."""
    if device != "CPU" or not (engine == "nccl" or gpus_asked):
        return None
    asked = "--engine nccl" if engine == "nccl" else "--gpus"
    return (f"{asked} asks for GPUs but this worker sees none (a container engine without the NVIDIA runtime, "
            "an executor without GPU resources, or CUDA_VISIBLE_DEVICES empty): it trains on the CPU.")


def horovod_import_error() -> str | None:
    """None if ``horovod.tensorflow`` imports, else a short reason. Horovod is never a dependency."""
    try:
        import horovod.tensorflow  # noqa: F401
    except Exception as exc:  # ImportError, or a build that does not match this TensorFlow
        return f"{type(exc).__name__}: {exc}"
    return None


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
    (``meeting``); an engine named with ``--engine`` (Gloo, NCCL, JAX's job, Horovod) is torch.distributed's
    or meets through its store. ``--strategy async`` and one worker use none."""
    import importlib.util

    has = has_module or (lambda name: importlib.util.find_spec(name) is not None)
    if world_size < 2 or strategy == "async" or engine is None or has("torch"):
        return None
    return (f"--engine {engine} runs over torch.distributed, and torch is not installed here: "
            "pip install 'nbdist[torch]' (a CPU build is enough without GPUs), or drop --engine: "
            "workers of this machine then sum through shared memory.")
