"""The backend interface: everything the driver calls to start N workers, watch them and stop them."""
from __future__ import annotations

from typing import Any, Protocol


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
    # The network interface Gloo uses between workers ("lo" when they all run on this machine),
    # None: Gloo picks from the host name.
    gloo_ifname: str | None
    # True: rank 0 binds its Gloo store on its own connection's address (a Spark executor's),
    # not on advertise_host (the driver's host).
    store_on_link: bool
    # What to change when a worker cannot reach the coordinator (e.g. which Spark setting), or "".
    unreachable_hint: str

    def default_workers(self) -> int: ...

    def launch(self, world_size: int, address: tuple[str, int], secret: bytes,
               threads_per_worker: int, data: Any = None) -> list[WorkerHandle]:
        """Start ``world_size`` workers connecting to ``address`` with ``secret``. ``data`` is a
        SparkData the Spark backend reads where it lives (one partition per worker); other
        backends ignore it, as their data travels in the job messages."""

    def partition_rows(self) -> list[int] | None:
        """Spark data: each task's row count once every task has read its partition, else None.
        Backends whose data travels in the job messages return None."""

    def stop(self, grace: float = 3.0) -> None:
        """End every worker (terminate, then kill after ``grace`` seconds) and wait for them."""

    def cleanup(self) -> None:
        """Remove what the run left on this machine (after ``stop``)."""
