"""Which backend a run uses: ``--backend auto`` is Spark when the notebook has a SparkSession (classic,
or a Spark Connect client, which has no SparkContext), else local processes."""
from __future__ import annotations

from ..backends import Backend
from ..config import TrainConfig
from ..errors import NbdistError


def resolve_backend(config: TrainConfig) -> Backend:
    name = config.backend
    if name in ("auto", "spark"):
        from ..spark.backend import NO_SPARK, SparkBackend, active_spark_session

        session = active_spark_session()
        if session is not None:
            return SparkBackend(session)
        if name == "spark":
            raise NbdistError(NO_SPARK)
        name = "local"
    if name == "local":
        from ..backends.local import LocalBackend

        return LocalBackend()
    from ..backends.containers import ContainerBackend  # the one name left: TrainConfig allows no other

    return ContainerBackend(config)

