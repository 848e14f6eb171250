"""Which backend a run uses and how many workers: ``--backend auto`` is Spark when the notebook has a
SparkSession (classic, or a Spark Connect client, which has no SparkContext), else local processes; the
world is the workers asked (or the backend's default), no more than the run's data can give each a part
of (``resolve_world``, the one place a run's world is decided, for every backend and strategy)."""
from __future__ import annotations

import logging

from ..backends import Backend
from ..config import TrainConfig
from ..data.sharding import run_world
from ..errors import NbdistError

log = logging.getLogger(__name__)


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
            return SparkBackend(session, config)
        if name == "spark":
            raise NbdistError(NO_SPARK)
        name = "local"
    if name == "local":
        from ..backends.local import LocalBackend

        return LocalBackend(config.local_share, config.local_slot, config.warm_workers)
    from ..backends.containers import ContainerBackend  # the one name left: TrainConfig allows no other

    return ContainerBackend(config)


def resolve_world(config: TrainConfig, backend: Backend, limits: dict[str, int],
                  what: str = "training data") -> tuple[int, str | None]:
    """The run's workers: ``--workers`` or the backend's default (said in one line when the backend says
    why, e.g. one per GPU), fewer where ``limits`` (``data.sharding.run_world``) allow fewer, said in one
    line too. Returns the world and that line (None: as asked)."""
    if not config.workers and getattr(backend, "workers_notice", None):  # one per GPU: the run's first line
        log.warning("%s", backend.workers_notice)
    world, note = run_world(config.workers or backend.default_workers(), limits, what)
    if note is not None:
        log.warning("%s", note)
    return world, note
