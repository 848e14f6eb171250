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
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..machine.keras_backend import configured_backend

log = logging.getLogger(__name__)


# How often a worker waiting in a Gloo call of an elastic run looks whether its driver gave the generation up.
WAIT_SLICE = datetime.timedelta(seconds=0.5)


# Process groups closed with a call left waiting for a peer that went silent: kept, never destroyed, since
# destroying one joins its Gloo thread, which ends only at the group's timeout. A worker exits by os._exit.
_LEFT_RUNNING: list[Any] = []


class GenerationBroken(RuntimeError):
    """An elastic run's driver said a member of this collective's generation is gone: its waits end at once."""


def broken_word(collective: Any) -> str | None:
    """Why ``collective``'s generation was given up (its ``broken``, set in an elastic run), else None."""
    broken = getattr(collective, "broken", None)
    return broken() if broken is not None else None


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


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds the IPv4 ``address``, if any."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def address_toward(peer: str) -> str | None:
    """This machine's address on its route to ``peer`` (a UDP connect picks the route and sends nothing)."""
    try:
        infos = socket.getaddrinfo(peer, 9, socket.AF_INET, socket.SOCK_DGRAM)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(infos[0][4])
            return str(s.getsockname()[0])
        except OSError:
            return None


_auto_choice: str | None = None  # what this module set, so a later call does not take it for the user's


def choose_gloo_interface(store_host: str, ifname: str | None = None) -> str | None:
    """Point Gloo at the interface that reaches rank 0's store; returns the interface used.

    Left to itself Gloo binds whatever this machine's hostname resolves to: loopback where the name
    is on 127.0.1.1 (Debian's default), or a management network the peers cannot reach. The route
    to the store's address is the one the peers share. GLOO_SOCKET_IFNAME set by the user (e.g.
    spark.executorEnv.GLOO_SOCKET_IFNAME) wins, then the backend's choice (loopback for local workers).
    """
    global _auto_choice
    user = os.environ.get("GLOO_SOCKET_IFNAME")
    chosen = (user if user and user != _auto_choice else None) or ifname
    if not chosen:
        source = address_toward(store_host)
        chosen = interface_of(source) if source else None
        if chosen is None:
            log.warning("no interface found toward %s; Gloo uses the one this host's name resolves to", store_host)
            return None
        _auto_choice = chosen
    os.environ["GLOO_SOCKET_IFNAME"] = chosen
    log.info("Gloo uses interface %s (toward the rendezvous at %s)", chosen, store_host)
    return chosen


class GlooCollective:
    """torch.distributed with the Gloo backend (CPU tensors, numpy zero-copy)."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, timeout: float,
                 listen_fd: int | None = None, ifname: str | None = None) -> None:
        import torch
        import torch.distributed as dist

        choose_gloo_interface(host, ifname)
        if configured_backend() != "torch":
            # On TensorFlow and JAX torch only carries Gloo's messages: its own pool stays at one thread. On
            # Keras' torch backend its threads are the model's: the worker's budget (worker/runtime.pin_threads).
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
        self.timeout = timeout  # seconds
        self._keys = 0
        # An elastic run's word that its generation is broken (worker/elastic.py): why, else None. Unset, a call
        # blocks until it ends (a sliced wait costs a large sum up to a tenth: benchmarks/gloo_wait.py).
        self.broken: Callable[[], str | None] | None = None
        self._left_waiting = False  # a call was left unfinished (GenerationBroken)

    @property
    def store(self):
        """The rendezvous store, for small side agreements between the workers."""
        return self._store

    def next_key(self, prefix: str) -> str:
        """A store key no earlier call on this worker used; every worker gets the same sequence."""
        self._keys += 1
        return f"nbdist/{prefix}/{self._keys}"

    def allreduce_sum(self, buf: np.ndarray) -> None:
        self._wait(self._dist.all_reduce(self._torch.from_numpy(buf), op=self._dist.ReduceOp.SUM, async_op=True))

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        self._wait(self._dist.broadcast(self._torch.from_numpy(buf), src=root, async_op=True))

    def _wait(self, work: Any) -> None:
        """Wait for ``work`` in slices, looking between them whether the generation was given up: a peer cut off
        from the network closes no connection, and a blocked Gloo call cannot be ended from another thread. A
        slice's timeout leaves the call running; the process group's own timeout still bounds it."""
        if self.broken is None:
            work.wait()
            return
        while True:
            try:
                work.wait(WAIT_SLICE)
                return
            except RuntimeError:
                if work.is_completed():  # it ended meanwhile, or failed by itself: its own result
                    work.wait()
                    return
            why = self.broken()
            if why:
                self._left_waiting = True
                raise GenerationBroken(why)

    def close(self) -> None:
        try:
            if self._left_waiting:  # the group's last reference going would wait for that call's own timeout
                _LEFT_RUNNING.append(self._dist.group.WORLD)
            self._dist.destroy_process_group()
        except Exception:  # already torn down by a failing peer
            log.debug("destroy_process_group failed", exc_info=True)
