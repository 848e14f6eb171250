"""The backend interface: start N workers pointed at the coordinator, watch them, stop them."""
from __future__ import annotations

from typing import Protocol


class WorkerHandle(Protocol):
    rank: int

    def exit_status(self) -> int | None:
        """The exit code once the worker has ended (negative: killed by that signal), else None."""

    def describe(self) -> str:
        """A short name for messages, e.g. 'worker 1 (pid 4242)'."""

    def log_tail(self, lines: int = 20) -> str:
        """The last lines the worker wrote to stdout/stderr."""


class Backend(Protocol):
    name: str
    bind_host: str  # where the coordinator listens
    advertise_host: str  # how workers reach it

    def default_workers(self) -> int: ...

    def launch(self, world_size: int, address: tuple[str, int], secret: bytes,
               threads_per_worker: int) -> list[WorkerHandle]: ...

    def stop(self, grace: float = 3.0) -> None:
        """End every worker (terminate, then kill after ``grace`` seconds) and wait for them."""
