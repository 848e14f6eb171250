"""Where workers come from. Every backend starts the same worker program."""
from __future__ import annotations

from ..config import TrainConfig
from ..errors import NbdistError
from .base import Backend, WorkerHandle


def resolve_backend(config: TrainConfig) -> Backend:
    name = config.backend
    if name in ("auto", "spark"):
        from .spark import NO_SPARK, SparkBackend, active_spark_context

        sc = active_spark_context()
        if sc is not None:
            return SparkBackend(sc)
        if name == "spark":
            raise NbdistError(NO_SPARK)
        name = "local"
    if name == "local":
        from .local import LocalBackend

        return LocalBackend()
    if name == "containers":
        from .containers import ContainerBackend

        return ContainerBackend(config)
    raise NbdistError(f"--backend {name} is not available yet; use --backend local.")


__all__ = ["Backend", "WorkerHandle", "resolve_backend"]
