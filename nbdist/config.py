"""One validated configuration for a training run; the magics and the API both build it."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from .errors import NbdistError

STRATEGIES = ("averaging", "allreduce")
BACKENDS = ("auto", "local", "spark", "containers")
UIS = ("auto", "widgets", "html", "text", "none")

# Options the interface reserves for capabilities that have not landed yet:
# asking for them gets a sentence, not a crash or a silent ignore.
NOT_AVAILABLE_YET: dict[str, Any] = {
    "checkpoint_dir": None,
    "resume": False,
    "max_restarts": 0,
    "engine": None,
    "image": None,
}


@dataclass(frozen=True)
class TrainConfig:
    epochs: int = 1
    batch_size: int = 32
    workers: int | None = None  # None: the backend's default
    strategy: str = "averaging"
    backend: str = "auto"
    averaging_frequency: int = 5
    average_optimizer: bool = True
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
    engine: str | None = None
    image: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        _positive_int("epochs", self.epochs, "--epochs 20")
        _positive_int("batch_size", self.batch_size, "--batch-size 32")
        _positive_int("averaging_frequency", self.averaging_frequency, "--averaging-frequency 5")
        if self.workers is not None:
            _positive_int("workers", self.workers, "--workers 2")
        if self.strategy not in STRATEGIES:
            raise NbdistError(f"unknown strategy {self.strategy!r}; use one of: {', '.join(STRATEGIES)}.")
        if self.backend not in BACKENDS:
            raise NbdistError(f"unknown backend {self.backend!r}; use one of: {', '.join(BACKENDS)}.")
        if self.ui not in UIS:
            raise NbdistError(f"unknown ui {self.ui!r}; use one of: {', '.join(UIS)}.")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise NbdistError(f"seed must be a non-negative integer, got {self.seed!r}.")
        for name in ("startup_timeout", "heartbeat_interval", "heartbeat_timeout", "sync_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise NbdistError(f"{name} must be a positive number of seconds, got {value!r}.")
        for name, default in NOT_AVAILABLE_YET.items():
            if getattr(self, name) != default:
                flag = "--" + name.replace("_", "-")
                raise NbdistError(f"{flag} is not available yet in nbdist {_version()}; run without it.")
        if self.strategy == "allreduce":
            raise NbdistError(
                f"--strategy allreduce is not available yet in nbdist {_version()}; use --strategy averaging."
            )
        if self.backend in ("spark", "containers"):
            raise NbdistError(
                f"--backend {self.backend} is not available yet in nbdist {_version()}; use --backend local."
            )

    def replace(self, **changes: Any) -> "TrainConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


def default_local_workers() -> int:
    return max(1, min(2, os.cpu_count() or 1))


def _positive_int(name: str, value: Any, example: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NbdistError(f"{name} must be a whole number of at least 1, got {value!r}; for example {example}.")


def _version() -> str:
    from . import __version__

    return __version__
