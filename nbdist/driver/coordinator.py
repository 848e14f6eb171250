"""Driver side of the wire: accepts workers, authenticates them, relays their messages.

Each connection gets a reader thread that turns frames into typed messages
(wire/catalog.py) in ``Event``s on one queue; the run (run.py) consumes that queue
on whichever thread waits for it. A connection that fails authentication is
dropped before anything it sent is interpreted; one that sends a message this
side cannot read is dropped too (its "closed" event names the protocol error).
"""
from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..wire import protocol
from ..wire.catalog import read
from ..wire.commands import Heartbeat
from ..wire.reports import Hello

log = logging.getLogger(__name__)


@dataclass
class Event:
    kind: str  # "connected" | "message" | "closed"
    rank: int
    message: Any = None  # the typed message (wire/reports.py): a Hello for "connected"
    detail: str = ""
    at: float = field(default_factory=time.monotonic)


class Coordinator:
    def __init__(self, secret: bytes, world_size: int, bind_host: str = "127.0.0.1",
                 advertise_host: str | None = None, heartbeat_interval: float = 2.0) -> None:
        self.secret = secret
        self.world_size = world_size
        self.events: queue.Queue[Event] = queue.Queue()
        self.rejected = 0  # connections dropped before they were accepted as a worker
        self.accepted = 0
        self.heartbeat_interval = heartbeat_interval
        self._channels: dict[int, protocol.Channel] = {}
        self._last_seen: dict[int, float] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind((bind_host, 0))
        self._server.listen(64)
        self.address = (advertise_host or bind_host, self._server.getsockname()[1])
        threading.Thread(target=self._accept, name="nbdist-accept", daemon=True).start()
        threading.Thread(target=self._beat, name="nbdist-driver-heartbeat", daemon=True).start()

    # -- connections ----------------------------------------------------
    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                sock, peer = self._server.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                # e.g. out of file descriptors under a connection flood: keep serving the real workers
                log.warning("accept failed: %s", exc)
                time.sleep(0.05)
                continue
            threading.Thread(target=self._serve, args=(sock, peer), daemon=True,
                             name=f"nbdist-conn-{peer[1]}").start()

    def _serve(self, sock: socket.socket, peer: Any) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            channel = protocol.server_handshake(sock, self.secret)
            sock.settimeout(protocol.HANDSHAKE_TIMEOUT)
            hello = read(channel.recv())  # a malformed one raises MessageError: rejected like any garbage
            sock.settimeout(None)
            if not isinstance(hello, Hello):
                raise protocol.ProtocolError(f"expected a hello, got a {hello.TYPE} message")
            if not 0 <= hello.rank < self.world_size:
                raise protocol.ProtocolError(f"bad hello: rank {hello.rank} of {self.world_size}")
            rank = hello.rank
            with self._lock:
                if rank in self._channels:
                    raise protocol.ProtocolError(f"rank {rank} connected twice")
                self._channels[rank] = channel
                self._last_seen[rank] = time.monotonic()
                self.accepted += 1
        except Exception as exc:
            with self._lock:  # many connection threads at once: count every one
                self.rejected += 1
                count = self.rejected
            # A flood (a port scan, an attack) must not flood the notebook's log too.
            (log.warning if count <= 5 else log.debug)("rejected a connection from %s: %s", peer, exc)
            sock.close()
            return
        self.events.put(Event("connected", rank, hello))
        reason = "connection closed"
        try:
            while True:
                msg = read(channel.recv())
                self._last_seen[rank] = time.monotonic()
                if not isinstance(msg, Heartbeat):
                    self.events.put(Event("message", rank, msg))
        except protocol.ConnectionClosed:
            pass
        except Exception as exc:  # an authenticated peer sent garbage (or a malformed message): drop it
            reason = f"protocol error: {exc}"
        with self._lock:
            if self._channels.get(rank) is channel:
                del self._channels[rank]
        channel.close()  # the worker's end is gone: its socket here is closed with it, not left to the collector
        if not self._closed.is_set():
            self.events.put(Event("closed", rank, detail=reason))

    def _beat(self) -> None:
        while not self._closed.wait(self.heartbeat_interval):
            self.broadcast(Heartbeat())

    # -- sending: typed messages (wire/messages.py, wire/commands.py) ----
    def send(self, rank: int, message: Any) -> None:
        with self._lock:
            channel = self._channels.get(rank)
        if channel is None:
            raise ConnectionError(f"worker {rank} is not connected")
        channel.send(*message.encode())

    def broadcast(self, message: Any) -> None:
        body, arrays = message.encode()
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            try:
                channel.send(body, arrays)
            except OSError:
                pass  # its reader will report the closed connection

    def silent_for(self, rank: int) -> float:
        seen = self._last_seen.get(rank)
        return 0.0 if seen is None else time.monotonic() - seen

    def connected(self) -> set[int]:
        with self._lock:
            return set(self._channels)

    def close(self) -> None:
        self._closed.set()
        try:  # close() alone does not wake a thread blocked in accept(): it and the port would live on
            self._server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._server.close()
        except OSError:
            pass
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()
