"""Where workers come from: local processes, warm ones, containers. Every backend starts the same worker
program; the driver picks one (driver/resolve.py). Spark's backend lives in spark/.

base.py: ``Backend`` and ``WorkerHandle``, all the driver calls to start N workers, watch them and stop them.
command.py: the worker program's command line and environment, built once for every way a worker starts.
local.py: N worker processes on this machine, each in its own process group (forked warm where it can).
warm.py: the fork servers kept per worker environment, which local workers are forked from.
containers.py: N worker containers (Podman or Docker) sharing the host's network, IPC and PID namespaces.
"""
from __future__ import annotations

from .base import Backend, WorkerHandle

__all__ = ["Backend", "WorkerHandle"]
