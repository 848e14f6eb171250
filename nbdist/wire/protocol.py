"""Framed, authenticated messages between the driver and its workers.

Every frame is ``header | payload | mac``: the header carries a magic, the protocol version, the frame kind,
a per-direction sequence number and the payload length; the MAC is HMAC-SHA256 over a direction byte, the
header and the payload, keyed by a session key both sides derive from the per-run secret and two fresh
nonces. So a forged frame fails the MAC, a replayed or reordered one the sequence check, one reflected to
its sender the direction byte, and one from an earlier connection the session key. Payloads are JSON
(control messages) or raw bytes (array data); nothing here ever unpickles.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..data.structures import all_zero

PROTOCOL_VERSION = 2  # 2: an all-zero array travels as its description alone
MAGIC = b"NBDS"
HEADER = struct.Struct("!4sBBQI")  # magic, version, kind, sequence, payload length
MAC_SIZE = 32
NONCE_SIZE = 32
MAX_PAYLOAD = 64 * 1024 * 1024  # larger arrays travel as several frames
CHUNK = 16 * 1024 * 1024
MAX_JSON = 16 * 1024 * 1024
HANDSHAKE_TIMEOUT = 15.0
# A worker's exit code when it cannot connect to the coordinator (it logs the address and the reason first).
EXIT_UNREACHABLE = 6

KIND_JSON = 1
KIND_BLOB = 2

# Only plain numeric and fixed-width text (str, bytes) dtypes cross the wire: never object arrays.
_ALLOWED_DTYPE_KINDS = set("biufc?US")


class ProtocolError(Exception):
    """A frame or handshake that is malformed, unauthenticated or out of order."""


class ConnectionClosed(ProtocolError):
    """The peer closed the connection."""


def new_secret() -> bytes:
    return os.urandom(32)


def _mac(key: bytes, direction: bytes, header: bytes | bytearray, payload: bytes | bytearray | memoryview) -> bytes:
    h = hmac.new(key, direction, hashlib.sha256)
    h.update(header)
    h.update(payload)
    return h.digest()


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return buf


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket: array data lands where the array lives, with no copy after it."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionClosed("connection closed by peer")
        got += k


@dataclass
class Message:
    """One logical message: a JSON body plus any arrays that followed it."""

    body: dict[str, Any]
    arrays: list[np.ndarray] = field(default_factory=list)

    @property
    def type(self) -> str:
        return str(self.body.get("type", ""))


class Channel:
    """An authenticated, sequenced, thread-safe (for sending) message stream."""

    def __init__(self, sock: socket.socket, key: bytes, is_server: bool) -> None:
        self.sock = sock
        self._key = key
        self._out_dir = b"S" if is_server else b"C"
        self._in_dir = b"C" if is_server else b"S"
        self._send_seq = 0
        self._recv_seq = 0
        self._send_lock = threading.Lock()
        self.closed = False

    # -- frames ---------------------------------------------------------
    def _send_frame(self, kind: int, payload: bytes | memoryview) -> None:
        if len(payload) > MAX_PAYLOAD:
            raise ProtocolError(f"frame of {len(payload)} bytes exceeds the {MAX_PAYLOAD}-byte limit")
        header = HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, self._send_seq, len(payload))
        mac = _mac(self._key, self._out_dir, header, payload)
        if len(payload) < 65536:
            self.sock.sendall(header + payload + mac)
        else:  # avoid copying a large payload just to prepend the header
            self.sock.sendall(header)
            self.sock.sendall(payload)
            self.sock.sendall(mac)
        self._send_seq += 1

    def _recv_frame(self) -> tuple[int, bytearray]:
        header, kind, length = self._recv_header()
        payload = _recv_exact(self.sock, length)
        self._check_mac(header, payload)
        return kind, payload

    def _recv_blob_into(self, view: memoryview) -> int:
        """The next frame, which must be array data, read into ``view``; its length. Not to be used before
        the MAC is checked: a forged frame raises here, and the message it belonged to is dropped whole."""
        header, kind, length = self._recv_header()
        if kind != KIND_BLOB:
            raise ProtocolError("expected array data, got a message header")
        if length > len(view):
            raise ProtocolError("array data longer than announced")
        _recv_into(self.sock, view[:length])
        self._check_mac(header, view[:length])
        return length

    def _recv_header(self) -> tuple[bytearray, int, int]:
        header = _recv_exact(self.sock, HEADER.size)
        magic, version, kind, seq, length = HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError("bad magic: not an nbdist frame")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {version} is not {PROTOCOL_VERSION}")
        if kind not in (KIND_JSON, KIND_BLOB):
            raise ProtocolError(f"unknown frame kind {kind}")
        if length > MAX_PAYLOAD:
            raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_PAYLOAD}-byte limit")
        if seq != self._recv_seq:
            raise ProtocolError(f"frame out of sequence (got {seq}, expected {self._recv_seq})")
        return header, kind, length

    def _check_mac(self, header: bytes | bytearray, payload: bytes | bytearray | memoryview) -> None:
        mac = _recv_exact(self.sock, MAC_SIZE)
        if not hmac.compare_digest(mac, _mac(self._key, self._in_dir, header, payload)):
            raise ProtocolError("frame failed authentication")
        self._recv_seq += 1

    # -- messages -------------------------------------------------------
    def send(self, body: dict[str, Any], arrays: list[np.ndarray] | tuple = ()) -> None:
        """Send a JSON body and, after it, the raw bytes of each array (none for an all-zero one: a fresh
        optimizer's slots are 200 MB of zeros for a 25M-parameter model under Adam)."""
        arrays = [np.asarray(a, order="C") for a in arrays]  # not ascontiguousarray: it makes 0-d 1-d
        meta = []
        for a in arrays:
            if a.dtype.kind not in _ALLOWED_DTYPE_KINDS:
                raise ProtocolError(f"cannot send an array of dtype {a.dtype}; only numeric and text arrays")
            meta.append({"dtype": a.dtype.str, "shape": list(a.shape)})
            if all_zero(a, min_bytes=65536):  # a small one costs less sent than checked
                meta[-1]["zeros"] = True
        full = dict(body)
        if meta:
            full["_arrays"] = meta
        data = json.dumps(full, separators=(",", ":")).encode()
        with self._send_lock:
            self._send_frame(KIND_JSON, data)
            for a, m in zip(arrays, meta):
                if m.get("zeros"):
                    continue
                raw = memoryview(a).cast("B") if a.size else memoryview(b"")
                for start in range(0, max(len(raw), 1), CHUNK):
                    self._send_frame(KIND_BLOB, raw[start:start + CHUNK])  # a view: no copy of the data

    def recv(self) -> Message:
        kind, payload = self._recv_frame()
        if kind != KIND_JSON:
            raise ProtocolError("expected a message header, got array data")
        if len(payload) > MAX_JSON:
            raise ProtocolError("message header too large")
        try:
            body = json.loads(payload)
        except ValueError as exc:
            raise ProtocolError(f"message is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ProtocolError("message is not a JSON object")
        arrays = [self._recv_array(m) for m in _array_meta(body.pop("_arrays", []))]
        return Message(body, arrays)

    def _recv_array(self, meta: tuple[np.dtype, tuple[int, ...], bool]) -> np.ndarray:
        dtype, shape, zeros = meta
        if zeros:
            return np.zeros(shape, dtype=dtype)  # the pages are the kernel's zeros until written
        out = np.empty(shape, dtype=dtype)
        view = memoryview(out.reshape(-1)).cast("B") if out.size else memoryview(bytearray(0))
        got = 0
        while True:  # an empty array still has its one empty frame
            got += self._recv_blob_into(view[got:])
            if got >= len(view):
                break
        return out

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _array_meta(items: Any) -> list[tuple[np.dtype, tuple[int, ...], bool]]:
    if not isinstance(items, list):
        raise ProtocolError("bad array list")
    out = []
    for m in items:
        try:
            dtype = np.dtype(str(m["dtype"]))
            shape = tuple(int(s) for s in m["shape"])
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("bad array description") from None
        if dtype.kind not in _ALLOWED_DTYPE_KINDS or any(s < 0 for s in shape):
            raise ProtocolError("array of a forbidden dtype or shape")
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > 1 << 40:
            raise ProtocolError("array too large")
        out.append((dtype, shape, m.get("zeros") is True))
    return out


# -- handshake: mutual challenge-response ---------------------------------
_HELLO = struct.Struct(f"!4sB{NONCE_SIZE}s")
_CLIENT = struct.Struct(f"!4sB{NONCE_SIZE}s{MAC_SIZE}s")


def _session_key(secret: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.new(secret, b"session" + server_nonce + client_nonce, hashlib.sha256).digest()


def server_handshake(sock: socket.socket, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> Channel:
    """Authenticate a connecting worker; raise ProtocolError if it cannot prove the secret."""
    sock.settimeout(timeout)
    server_nonce = os.urandom(NONCE_SIZE)
    sock.sendall(_HELLO.pack(MAGIC, PROTOCOL_VERSION, server_nonce))
    magic, version, client_nonce, proof = _CLIENT.unpack(_recv_exact(sock, _CLIENT.size))
    if magic != MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError("peer does not speak this protocol version")
    expected = hmac.new(secret, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()
    if not hmac.compare_digest(proof, expected):
        raise ProtocolError("peer failed authentication")
    sock.sendall(hmac.new(secret, b"server" + client_nonce + server_nonce, hashlib.sha256).digest())
    sock.settimeout(None)
    return Channel(sock, _session_key(secret, server_nonce, client_nonce), is_server=True)


def client_handshake(sock: socket.socket, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> Channel:
    """Prove the secret to the driver and check that the driver knows it too."""
    sock.settimeout(timeout)
    magic, version, server_nonce = _HELLO.unpack(_recv_exact(sock, _HELLO.size))
    if magic != MAGIC or version != PROTOCOL_VERSION:
        raise ProtocolError("driver does not speak this protocol version")
    client_nonce = os.urandom(NONCE_SIZE)
    proof = hmac.new(secret, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()
    sock.sendall(_CLIENT.pack(MAGIC, PROTOCOL_VERSION, client_nonce, proof))
    answer = _recv_exact(sock, MAC_SIZE)
    expected = hmac.new(secret, b"server" + client_nonce + server_nonce, hashlib.sha256).digest()
    if not hmac.compare_digest(answer, expected):
        raise ProtocolError("driver failed authentication")
    sock.settimeout(None)
    return Channel(sock, _session_key(secret, server_nonce, client_nonce), is_server=False)


def connect(address: tuple[str, int], secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> Channel:
    sock = socket.create_connection(address, timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return client_handshake(sock, secret, timeout)
