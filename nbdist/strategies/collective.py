"""Collective operations behind a small interface; the default engine is torch.distributed.

Parameter averaging and gradient allreduce both reduce to "sum this flat
buffer across workers", so each strategy needs only this interface. The
rendezvous store binds to the address the backend chose (loopback for local
workers) through a socket we create ourselves, since TCPStore would otherwise
listen on every interface.
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)


class Collective(Protocol):
    rank: int
    world_size: int

    def allreduce_sum(self, buf: np.ndarray) -> None:
        """Sum ``buf`` in place across all workers."""

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        """Overwrite ``buf`` in place with root's values."""

    def close(self) -> None: ...


class SoloCollective:
    """One worker: every collective is the identity."""

    rank = 0
    world_size = 1

    def allreduce_sum(self, buf: np.ndarray) -> None:
        pass

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        pass

    def close(self) -> None:
        pass


def open_store_listener(bind_host: str) -> tuple[int, int]:
    """Listen on ``bind_host`` for the rendezvous store; return (fd, port)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((bind_host, 0))
    sock.listen(128)
    port = sock.getsockname()[1]
    return sock.detach(), port  # the store owns the descriptor from now on


class GlooCollective:
    """torch.distributed with the Gloo backend (CPU tensors, numpy zero-copy)."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, timeout: float,
                 listen_fd: int | None = None, ifname: str | None = None) -> None:
        import torch
        import torch.distributed as dist

        if ifname:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        torch.set_num_threads(1)
        td = datetime.timedelta(seconds=timeout)
        kwargs = {"use_libuv": False}
        if listen_fd is not None:
            kwargs["master_listen_fd"] = listen_fd
        self._store = dist.TCPStore(host, port, world_size, rank == 0, timeout=td,
                                    wait_for_workers=False, **kwargs)
        dist.init_process_group("gloo", store=self._store, rank=rank, world_size=world_size, timeout=td)
        self._dist = dist
        self._torch = torch
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout  # seconds; bounds every wait of the point-to-point ring too
        self._keys = 0

    @property
    def store(self):
        """The rendezvous store, for small side agreements between the workers."""
        return self._store

    def next_key(self, prefix: str) -> str:
        """A store key no earlier call on this worker used; every worker gets the same sequence."""
        self._keys += 1
        return f"nbdist/{prefix}/{self._keys}"

    def allreduce_sum(self, buf: np.ndarray) -> None:
        self._dist.all_reduce(self._torch.from_numpy(buf), op=self._dist.ReduceOp.SUM)

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        self._dist.broadcast(self._torch.from_numpy(buf), src=root)

    def close(self) -> None:
        try:
            self._dist.destroy_process_group()
        except Exception:  # already torn down by a failing peer
            log.debug("destroy_process_group failed", exc_info=True)
