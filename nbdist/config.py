"""One validated configuration for a training run; the magics and the API both build it."""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any

from .errors import NbdistError
from .machine.engines import BUCKET_BYTES, Choice, check_choice

STRATEGIES = ("averaging", "allreduce", "async")
BACKENDS = ("auto", "local", "spark", "containers")
UIS = ("auto", "widgets", "html", "text", "none")
LR_SCALINGS = ("auto", "none", "linear")
MLFLOW_ACTIVE = ("nest", "use")


def implied_strategy(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with ``strategy="averaging"`` where an averaging frequency is given and no strategy: it has
    no other meaning, and under the default (allreduce) it would be ignored without a word."""
    if options.get("strategy") is None and options.get("averaging_frequency") is not None:
        return {**options, "strategy": "averaging"}
    return options


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    batch_size: int = 32
    # None: the backend's default. "MIN:MAX" (elastic, allreduce): the run starts with MAX workers and goes on
    # while at least MIN are left, a lost one costing the steps since the last commit (docs/elastic.md); it is
    # held here as workers=MAX and min_workers=MIN.
    workers: int | str | None = None
    min_workers: int | None = None
    # Elastic runs: every worker commits its state in memory at each epoch's start and, given K, every K optimizer
    # steps as well; a lost worker then costs at most K steps (None: epoch starts only; docs/elastic.md).
    commit_every: int | None = None
    # None: allreduce (local Keras' step), or averaging, said in one line, for a model whose own
    # train_step applies optimizers besides model.optimizer (model_io.chosen_strategy, at launch).
    strategy: str | None = None
    backend: str = "auto"
    averaging_frequency: int = 5
    average_optimizer: bool = True
    # --strategy async: deltas computed from shared weights more than this many versions old are refused
    # (None: 4 x workers, strategies/async_sgd.py).
    max_staleness: int | None = None
    # "auto": linear scaling for adaptive optimizers, none for plain SGD (see strategies/lr_scaling.py).
    lr_scaling: str = "auto"
    seed: int | None = None
    shuffle: bool = True
    ui: str = "auto"
    background: bool = False
    # Seconds. Worker start covers importing TensorFlow on a loaded machine.
    startup_timeout: float = 180.0
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 60.0
    sync_timeout: float = 300.0
    checkpoint_dir: str | None = None
    resume: bool = False
    max_restarts: int = 0
    # How the workers sum (machine/engines.py chooses from these and the workers' GPUs and machines).
    # engine, allreduce only: None (NCCL with a GPU per worker, JAX's psum on JAX with one, else shared memory
    # or Gloo), "gloo", "nccl" or "jax".
    engine: str | None = None
    # "auto": tensors summed where they are on GPUs, in host memory on CPUs; "always": where they are even on
    # CPUs (torch's Gloo on CPU tensors, JAX's psum over Gloo: the GPU's code path, for tests); "never": host.
    device_sum: str = "auto"
    overlap: bool = True  # torch: the device sum's buckets start during the backward pass
    bucket_bytes: int = BUCKET_BYTES  # the device sum's buckets (PyTorch DDP's 25 MiB)
    # Host buckets whose copies to all peers come to at most direct_sum_bytes are summed through one row of
    # shared memory (strategies/shared.py) when every worker runs on this machine; larger ones chunk by chunk
    # through rows of shared_chunk_bytes. shared_memory=False, or several machines: Gloo's allreduce.
    direct_sum_bytes: int = 4 * 2**20
    shared_memory: bool = True
    shared_chunk_bytes: int = 2 * 2**20
    # TensorFlow workers run Keras' Adam and SGD updates as TensorFlow's fused kernels, the same
    # formula in one pass instead of about ten (strategies/fused_updates.py). None: for models of at
    # least FUSED_MIN_PARAMETERS trainable parameters, where the passes are the cost (smaller models
    # keep Keras' ops and its last bit); True: always; False: never.
    fused_updates: bool | None = None
    # Spark data: each worker streams its partition from its task's file; this many bytes of rows are
    # held and shuffled together (the shuffle window, worker/streams.py). Its memory for the data is
    # about twice this plus a few blocks, whatever the partition's size.
    stream_buffer_bytes: int = 64 * 2**20
    image: str | None = None
    # --backend containers: per-worker limits and GPU passthrough ("all" or "0,1"); None: no limit/none.
    container_cpus: float | None = None
    container_memory: str | None = None
    container_gpus: str | None = None
    # MLflow tracking (nbdist/ui/tracking.py): None logs when the notebook uses MLflow (a tracking URI set,
    # autologging or an active run), True always (--mlflow), False never (--no-mlflow). run_name names
    # the MLflow run; mlflow_active says what an MLflow run active in the notebook is: "nest" (this
    # run's parent) or "use" (this run logs into it).
    mlflow: bool | None = None
    run_name: str | None = None
    mlflow_active: str = "nest"
    # Local workers of this many runs share the machine at once (a search's parallel trials): each
    # run's workers get cores // (local_share * workers) threads and, where the cores go round,
    # their own cores, those of share number local_slot (0 .. local_share - 1). 1: the run has it all.
    local_share: int = 1
    local_slot: int = 0
    # Where the workers come from; a notebook sets these once for its session (%config DistMagics.<name>,
    # magics/train.py), a program passes them as options. warm_workers: local workers fork from a fork server
    # that has imported Keras already (backends/warm.py) and Spark executors keep warm workers
    # (spark/warm.py); False: every worker starts afresh.
    warm_workers: bool = True
    # Spark: seconds to wait for registered executors with a task slot per worker (a YARN or Kubernetes
    # cluster that starts them on demand may need longer).
    executor_wait: float = 20.0
    # Spark: the notebook's address as the executors reach it (a NAT, a VPN); the listeners then bind every
    # interface. None: the driver's address on its route to the executors (spark/backend.py session_hosts).
    advertise_host: str | None = None
    # --backend containers: the container engine's binary, a name on the PATH or a path (None: podman,
    # else docker).
    container_engine: str | None = None
    # Each worker times every epoch's phases and reports them (worker/phases.py; benchmarks).
    phase_times: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.workers, str):  # "MIN:MAX", or a number as text: held as numbers (frozen: set once)
            low, high = parse_workers(self.workers)
            object.__setattr__(self, "workers", high)
            if low is not None:
                object.__setattr__(self, "min_workers", low)
        self.validate()

    @property
    def elastic(self) -> bool:
        """The run goes on without a lost worker (``workers="MIN:MAX"``)."""
        return self.min_workers is not None

    def validate(self) -> None:
        _positive_int("epochs", self.epochs, "--epochs 20")
        _positive_int("batch_size", self.batch_size, "--batch-size 32")
        _positive_int("averaging_frequency", self.averaging_frequency, "--averaging-frequency 5")
        if self.workers is not None:
            _positive_int("workers", self.workers, "--workers 2")
        _validate_elastic(self)
        if self.max_staleness is not None:
            if self.strategy != "async":
                raise NbdistError("--max-staleness applies to --strategy async; add --strategy async or drop it.")
            _positive_int("max_staleness", self.max_staleness, "--max-staleness 8")
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise NbdistError(f"unknown strategy {self.strategy!r}; use one of: {', '.join(STRATEGIES)}.")
        if self.backend not in BACKENDS:
            raise NbdistError(f"unknown backend {self.backend!r}; use one of: {', '.join(BACKENDS)}.")
        if self.ui not in UIS:
            raise NbdistError(f"unknown ui {self.ui!r}; use one of: {', '.join(UIS)}.")
        if self.lr_scaling not in LR_SCALINGS:
            raise NbdistError(f"unknown lr scaling {self.lr_scaling!r}; use one of: {', '.join(LR_SCALINGS)}.")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise NbdistError(f"seed must be a non-negative integer, got {self.seed!r}.")
        for name in ("startup_timeout", "heartbeat_interval", "heartbeat_timeout", "sync_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise NbdistError(f"{name} must be a positive number of seconds, got {value!r}.")
        if not isinstance(self.direct_sum_bytes, int) or self.direct_sum_bytes < 0:
            raise NbdistError("direct_sum_bytes must be a non-negative number of bytes, "
                              f"got {self.direct_sum_bytes!r}.")
        if not isinstance(self.shared_chunk_bytes, int) or self.shared_chunk_bytes < 64:
            raise NbdistError("shared_chunk_bytes must be a number of bytes of at least 64, "
                              f"got {self.shared_chunk_bytes!r}.")
        if isinstance(self.stream_buffer_bytes, bool) or not isinstance(self.stream_buffer_bytes, int) \
                or self.stream_buffer_bytes < 1:
            raise NbdistError("stream_buffer_bytes must be a positive number of bytes, got "
                              f"{self.stream_buffer_bytes!r}; for example --stream-buffer 64 (MiB).")
        if not isinstance(self.shared_memory, bool):
            raise NbdistError(f"shared_memory must be True or False, got {self.shared_memory!r}.")
        _positive_int("local_share", self.local_share, "local_share=2")
        if isinstance(self.local_slot, bool) or not isinstance(self.local_slot, int) \
                or not 0 <= self.local_slot < self.local_share:
            raise NbdistError(f"local_slot must be a whole number from 0 to local_share - 1 ({self.local_share - 1}), "
                              f"got {self.local_slot!r}.")
        _validate_checkpointing(self)
        if not isinstance(self.overlap, bool):
            raise NbdistError(f"overlap must be True or False, got {self.overlap!r}.")
        check_choice(self.engine_choice())
        if self.engine is not None and self.strategy == "averaging":
            raise NbdistError(f"--engine {self.engine} applies to --strategy allreduce; "
                              "add --strategy allreduce or drop --engine.")
        _validate_containers(self)
        _validate_tracking(self)
        _validate_session(self)

    def engine_choice(self) -> Choice:
        """The engine-related fields, as the selector takes them (machine/engines.py)."""
        return engine_choice(self)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def engine_choice(settings: Any) -> Choice:
    """The engine-related fields of a TrainConfig or a job's TrainSettings, as the selector takes them."""
    return Choice(settings.engine, settings.device_sum, settings.overlap, settings.bucket_bytes,
                  settings.shared_memory, settings.direct_sum_bytes, settings.shared_chunk_bytes)


def default_local_workers() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def _validate_containers(cfg: TrainConfig) -> None:
    options = {"image": "--image", "container_cpus": "--cpus", "container_memory": "--memory",
               "container_gpus": "--gpus"}
    given = [flag for name, flag in options.items() if getattr(cfg, name) is not None]
    if given and cfg.backend != "containers":
        raise NbdistError(f"{', '.join(given)} only applies to --backend containers; add --backend containers "
                          "or drop the option.")
    if cfg.image is not None and (not isinstance(cfg.image, str) or not cfg.image.strip()):
        raise NbdistError(f"--image must name a container image that has nbdist installed, got {cfg.image!r}.")
    cpus = cfg.container_cpus
    if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus <= 0):
        raise NbdistError(f"--cpus must be a positive number of CPUs per worker, got {cpus!r}; for example --cpus 1.")
    mem = cfg.container_memory
    if mem is not None and (not isinstance(mem, str) or not re.match(r"^\d+(\.\d+)?[bkmg]?$", mem, re.I)):
        raise NbdistError(f"--memory must be an amount like 2g or 512m per worker, got {mem!r}.")
    gpus = cfg.container_gpus
    if gpus is not None and (not isinstance(gpus, str) or not re.match(r"^(all|\d+(,\d+)*)$", gpus)):
        raise NbdistError(f"--gpus must be 'all' or GPU indices like 0,1, got {gpus!r}.")


def _validate_session(cfg: TrainConfig) -> None:
    for name in ("warm_workers", "phase_times"):
        if not isinstance(getattr(cfg, name), bool):
            raise NbdistError(f"{name} must be True or False, got {getattr(cfg, name)!r}.")
    wait = cfg.executor_wait
    if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < float("inf"):
        raise NbdistError(f"executor_wait must be a number of seconds of at least 0, got {wait!r}; "
                          "for example executor_wait=60.")
    host = cfg.advertise_host
    if host is not None and (not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host)):
        raise NbdistError(f"advertise_host must be an address of this machine that the Spark executors can reach, "
                          f"got {host!r}; for example advertise_host='10.0.0.5'.")
    engine = cfg.container_engine
    if engine is not None and (not isinstance(engine, str) or not engine.strip()):
        raise NbdistError(f"container_engine must name the podman or docker binary, got {engine!r}; "
                          "for example container_engine='podman'.")


def _validate_tracking(cfg: TrainConfig) -> None:
    if cfg.mlflow not in (None, True, False):
        raise NbdistError(f"mlflow must be True, False or None (log when the notebook uses MLflow), "
                          f"got {cfg.mlflow!r}.")
    if cfg.run_name is not None and (not isinstance(cfg.run_name, str) or not cfg.run_name.strip()):
        raise NbdistError(f"--run-name must be a non-empty name for the MLflow run, got {cfg.run_name!r}.")
    if cfg.mlflow_active not in MLFLOW_ACTIVE:
        raise NbdistError(f"--mlflow-active {cfg.mlflow_active!r}: use nest (a child run of the notebook's active "
                          "MLflow run) or use (log into it).")


WORKERS_RANGE = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$")


def parse_workers(text: str) -> tuple[int | None, int]:
    """``"3"`` -> (None, 3); ``"2:3"`` -> (2, 3); anything else refused in one sentence."""
    if text.strip().isdigit():
        return None, int(text)
    found = WORKERS_RANGE.match(text)
    if found is None:
        raise NbdistError(f"workers must be a number or MIN:MAX, got {text!r}; for example --workers 2:3 "
                          "(start with 3, go on while 2 are left).")
    return int(found.group(1)), int(found.group(2))


def _validate_elastic(cfg: TrainConfig) -> None:
    low, high = cfg.min_workers, cfg.workers
    if low is None:
        if cfg.commit_every is not None:
            raise NbdistError("commit_every applies to an elastic run; give workers as MIN:MAX "
                              "(for example --workers 2:3) or drop commit_every.")
        return
    if isinstance(low, bool) or not isinstance(low, int) or low < 1 or high is None or low > high:
        raise NbdistError(f"workers MIN:MAX needs 1 <= MIN <= MAX, got {low}:{high}; for example --workers 2:3.")
    if cfg.strategy not in (None, "allreduce"):
        raise NbdistError(f"workers MIN:MAX (elastic) trains under allreduce; --strategy {cfg.strategy} keeps a "
                          "fixed number of workers: drop --strategy or give --workers a single number.")
    k = cfg.commit_every
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise NbdistError(f"commit_every must be a positive number of steps, got {k!r}; for example --commit-every 10 "
                          "(or drop it to commit at each epoch's start only).")


def _validate_checkpointing(cfg: TrainConfig) -> None:
    d = cfg.checkpoint_dir
    if d is not None and (not isinstance(d, (str, os.PathLike)) or not os.fspath(d).strip()):
        raise NbdistError(f"--checkpoint-dir must name a directory, got {d!r}; for example --checkpoint-dir ckpt.")
    if not isinstance(cfg.resume, bool):
        raise NbdistError(f"resume must be True or False, got {cfg.resume!r}.")
    if cfg.resume and d is None:
        raise NbdistError("--resume continues the run saved in --checkpoint-dir DIR; add --checkpoint-dir "
                          "with the directory to resume from.")
    n = cfg.max_restarts
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise NbdistError(f"--max-restarts must be a whole number of at least 0, got {n!r}; "
                          "for example --max-restarts 2.")


def _positive_int(name: str, value: Any, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NbdistError(f"{name} must be a whole number of at least 1, got {value!r}; for example {example}.")
