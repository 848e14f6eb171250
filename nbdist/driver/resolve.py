"""Which backend a run uses: ``--backend auto`` is Spark when the notebook has a SparkSession (classic,
or a Spark Connect client, which has no SparkContext), else local processes."""
from __future__ import annotations

from ..backends import Backend
from ..config import TrainConfig
from ..errors import NbdistError


def runs_locally(config: TrainConfig) -> bool:
    """Whether ``resolve_backend`` gives local processes, without making the backend."""
    if config.backend != "auto":
        return config.backend == "local"
    from ..spark.backend import active_spark_session

    return active_spark_session() is None


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

        return LocalBackend(config.local_share, config.local_slot)
    from ..backends.containers import ContainerBackend  # the one name left: TrainConfig allows no other

    return ContainerBackend(config)

