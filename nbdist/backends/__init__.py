"""Where workers come from: local processes, warm ones, containers. Every backend starts the same worker
program; the driver picks one (driver/resolve.py)."""
from __future__ import annotations

from .base import Backend, WorkerHandle

__all__ = ["Backend", "WorkerHandle"]
