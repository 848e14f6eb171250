"""Which engine sums a run's gradients or averaging rounds: one ordered, pure choice (``select``).

Facts about the workers (Keras backend, strategy, GPUs, machines, bucket size) and the user's typed choices
(``--engine``, ``device_sum``, ``overlap``, ``bucket_bytes``, ``shared_memory``) give a ``Plan``: shared memory
(workers of one machine, "small" or "chunked"), torch.distributed (Gloo or NCCL, on host buckets or on the
tensors where they are, overlapped with torch's backward pass) or JAX's psum. Every worker computes the same
facts (summed over the collective), so all choose alike. An impossible ask is refused in one sentence.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import NbdistError

BACKENDS = ("tensorflow", "jax", "torch")
GPUS = ("none", "own", "shared")  # every worker without a GPU / with one of its own / otherwise
ENGINES = ("gloo", "nccl", "jax")  # --engine (None: chosen here)
DEVICE_SUMS = ("auto", "always", "never")
BUCKET_BYTES = 25 * 2**20  # the device sum's buckets (PyTorch DDP's default)
SMALL_BYTES = 4 * 2**20  # a bucket whose copies to all peers are at most this is summed in one shared row
CHUNK_BYTES = 2 * 2**20

HOROVOD_GONE = ("--engine horovod is gone: Horovod 0.28.1, its last release, does not build with TensorFlow "
                ">= 2.16; drop --engine (NCCL on GPUs, Gloo on CPUs) or use --engine nccl.")
JAX_ONLY = ("--engine jax sums with JAX's own collectives and needs Keras' jax backend (KERAS_BACKEND=jax); "
            "use --engine gloo or nccl on this backend.")
NCCL_NOT_ON_JAX = ("--engine nccl is not driven on Keras' jax backend; use --engine jax (JAX's own collectives, "
                   "NCCL inside XLA on GPUs) or --engine gloo.")


@dataclass(frozen=True)
class Facts:
    """What the workers are: the same on every worker (each fact summed over the collective)."""

    backend: str  # Keras' backend: tensorflow, jax or torch
    strategy: str = "allreduce"  # or "averaging"
    world: int = 2
    gpus: str = "none"  # GPUS
    obstacle: str | None = None  # gpus "shared": why NCCL cannot sum ("workers 0 and 1 share one GPU")
    one_host: bool = True  # every worker on this machine (one kernel)
    bucket_bytes: int = 0  # the flat bucket: gradients and the rows slot, or the averaged variables
    equal_steps: bool | None = None  # every step the same rows on every worker (None: not known)
    has_torch: bool = True  # torch.distributed importable (else only shared memory sums)


@dataclass(frozen=True)
class Choice:
    """The user's typed choices (TrainConfig, through the job's settings)."""

    engine: str | None = None
    device_sum: str = "auto"  # "always": tensors summed where they are, even on CPUs; "never": host buckets
    overlap: bool = True  # torch: device buckets started during the backward pass
    bucket_bytes: int = BUCKET_BYTES
    shared_memory: bool = True
    small_bytes: int = SMALL_BYTES
    chunk_bytes: int = CHUNK_BYTES


@dataclass(frozen=True)
class Plan:
    """The engine that sums: ``none`` (one worker), ``shared`` (mode small | chunked), ``torch`` (mode gloo |
    nccl; tensors host | device; overlap) or ``jax`` (psum inside the step). ``bucket_bytes``: the device
    sum's buckets, or the chunked shared sum's rows. ``notice``: the one line the run says."""

    engine: str
    mode: str = ""
    tensors: str = "host"
    overlap: bool = False
    bucket_bytes: int = 0
    notice: str | None = None

    @property
    def device(self) -> bool:
        """Whether the tensors are summed where they are (on their device), not in a host bucket."""
        return self.engine == "jax" or self.tensors == "device"

    @property
    def summed_by(self) -> str | None:
        """How reports name it: shared, shared-chunked, allreduce (Gloo on host buckets), device,
        device-overlapped; None for one worker."""
        if self.engine == "none":
            return None
        if self.engine == "shared":
            return "shared" if self.mode == "small" else "shared-chunked"
        if self.device:
            return "device-overlapped" if self.overlap else "device"
        return "allreduce"

    @property
    def engine_name(self) -> str:
        """The name reports give the engine (``--engine``'s words): none, gloo (host buckets, in shared memory
        or over Gloo, and device tensors over Gloo), nccl or jax; ``summed_by`` says more."""
        return "gloo" if self.engine == "shared" else self.mode if self.engine == "torch" else self.engine


def nccl_obstacle(gpus: Sequence[object]) -> str | None:
    """Why NCCL cannot sum for workers with these GPUs (by rank: an identity, or a false value for none), as a
    clause; None where every worker has a GPU of its own (NCCL refuses two ranks on one device)."""
    lacking = [str(rank) for rank, gpu in enumerate(gpus) if not gpu]
    if not gpus:
        return "there are no workers"
    if lacking:
        return f"worker {lacking[0]} has no GPU" if len(lacking) == 1 else f"workers {', '.join(lacking)} have no GPU"
    first: dict[object, int] = {}
    for rank, gpu in enumerate(gpus):
        if gpu in first:
            return f"workers {first[gpu]} and {rank} share one GPU"
        first[gpu] = rank
    return None


def gpu_facts(gpus: Sequence[object]) -> tuple[str, str | None]:
    """(``Facts.gpus``, ``Facts.obstacle``) from every worker's GPU identity by rank."""
    if not any(gpus):
        return "none", None
    obstacle = nccl_obstacle(gpus)
    return ("own", None) if obstacle is None else ("shared", obstacle)


def sharing_notice(obstacle: str) -> str:
    """The one line a run on GPUs says when it sums through host memory instead, and what that costs."""
    return (f"{obstacle[0].upper()}{obstacle[1:]}, and NCCL needs a GPU of its own for every worker: the "
            "gradients are summed over Gloo, through host memory (each step copies them off the GPU and back).")


def unequal_rows_notice(asked: bool) -> str:
    """Why JAX's psum gives way to the host path: every process runs one program, and the rows differ."""
    if asked:
        return ("--engine jax needs the same rows per step on every worker (rows divisible by the workers, array "
                "data); these shares differ, so the gradients are summed over Gloo.")
    return ("Every worker has a GPU of its own, but JAX's sum on the GPUs needs the same rows per step on every "
            "worker (rows divisible by the workers, array data) and these shares differ: the gradients are summed "
            "over Gloo, through host memory (each step copies them off the GPU and back).")


def check_choice(choice: Choice) -> None:
    """Refuse a value no placement could use, in one sentence (the config calls this at the door)."""
    if choice.engine == "horovod":
        raise NbdistError(HOROVOD_GONE)
    if choice.engine is not None and choice.engine not in ENGINES:
        raise NbdistError(f"unknown engine {choice.engine!r}; use one of: {', '.join(ENGINES)}.")
    if choice.device_sum not in DEVICE_SUMS:
        raise NbdistError(f"device_sum must be one of {', '.join(DEVICE_SUMS)}, got {choice.device_sum!r}: "
                          "always sums tensors where they are, even on CPUs; never sums in host memory.")
    if choice.engine == "nccl" and choice.device_sum == "never":
        raise NbdistError("--engine nccl sums tensors on their GPUs, and device_sum='never' asks for host memory; "
                          "drop one of them.")
    for name in ("bucket_bytes", "small_bytes", "chunk_bytes"):
        value = getattr(choice, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "small_bytes" else 64):
            raise NbdistError(f"{name} must be a whole number of bytes of at least "
                              f"{0 if name == 'small_bytes' else 64}, got {value!r}.")


def select(facts: Facts, choice: Choice = Choice()) -> Plan:
    """The plan for these workers and choices, decided in this order: one worker; what was asked by name;
    the workers' GPUs; ``device_sum``; then the host path by machines and size. Raises NbdistError for an
    impossible ask."""
    check_choice(choice)
    if facts.backend not in BACKENDS:
        raise NbdistError(f"unknown Keras backend {facts.backend!r}; nbdist trains on {', '.join(BACKENDS)}.")
    if facts.world < 2:
        return Plan("none")
    engine, backend = choice.engine, facts.backend
    if engine is not None and not facts.has_torch and not (engine == "jax" and backend == "jax"):
        raise NbdistError(f"--engine {engine} runs over torch.distributed, and torch is not installed here: "
                          "pip install 'nbdist[torch]', or drop --engine: workers of this machine then sum "
                          "through shared memory.")
    if engine == "jax" and backend != "jax":
        raise NbdistError(JAX_ONLY)
    if engine == "nccl" and backend == "jax":
        raise NbdistError(NCCL_NOT_ON_JAX)
    if engine in ("nccl", "jax") and facts.gpus == "shared":
        raise NbdistError(f"--engine {engine} needs a GPU of its own for every worker and {facts.obstacle}; use "
                          "--engine gloo (the default then), or give each worker its own GPU (--workers at most "
                          "the GPUs).")
    if engine == "nccl" and facts.gpus == "none":
        raise NbdistError("--engine nccl needs a GPU on every worker and these workers have none; "
                          "use --engine gloo (the default on CPUs).")
    notice = sharing_notice(facts.obstacle or "some workers share a GPU") if facts.gpus == "shared" else None
    if backend == "jax":
        psum = engine == "jax" or (engine is None and choice.device_sum != "never"
                                   and (facts.gpus == "own" or choice.device_sum == "always"))
        if not psum:
            return _host(facts, choice, notice)
        if facts.strategy == "allreduce" and facts.equal_steps is False:  # every process runs one program
            return _host(facts, choice, unequal_rows_notice(engine == "jax"))
        return Plan("jax", tensors="device", bucket_bytes=choice.bucket_bytes)
    on_device = engine == "nccl" or choice.device_sum == "always" or (
        choice.device_sum == "auto" and engine is None and facts.gpus == "own")
    if not on_device:
        return _host(facts, choice, notice)
    if not facts.has_torch:
        raise NbdistError("summing tensors where they are runs over torch.distributed, and torch is not installed "
                          "here: pip install 'nbdist[torch]', or drop device_sum='always'.")
    mode = "nccl" if facts.gpus == "own" and engine != "gloo" else "gloo"
    overlap = choice.overlap and backend == "torch" and facts.strategy == "allreduce"
    return Plan("torch", mode, "device", overlap, choice.bucket_bytes)


def _host(facts: Facts, choice: Choice, notice: str | None) -> Plan:
    """Host buckets: shared memory between workers of one machine (one row when its copies to all peers are
    at most ``small_bytes``, else chunk by chunk), otherwise Gloo's allreduce."""
    if facts.one_host and (choice.shared_memory or not facts.has_torch):
        small = facts.bucket_bytes * (facts.world - 1) <= choice.small_bytes
        return Plan("shared", "small" if small else "chunked", bucket_bytes=choice.chunk_bytes, notice=notice)
    if not facts.has_torch:
        raise NbdistError("workers on several machines sum over torch.distributed, and torch is not installed "
                          "here: pip install 'nbdist[torch]' (a CPU build is enough without GPUs).")
    return Plan("torch", "gloo", notice=notice)
