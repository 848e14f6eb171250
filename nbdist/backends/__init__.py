"""Where workers come from. Every backend starts the same worker program."""
from __future__ import annotations

from ..config import TrainConfig
from ..errors import NbdistError
from .base import Backend, WorkerHandle


def resolve_backend(config: TrainConfig) -> Backend:
    name = config.backend
    if name == "auto":
        name = "local"
    if name == "local":
        from .local import LocalBackend

        return LocalBackend()
    if name == "containers":
        from .containers import ContainerBackend

        return ContainerBackend(config)
    raise NbdistError(f"--backend {name} is not available yet; use --backend local.")


__all__ = ["Backend", "WorkerHandle", "resolve_backend"]
