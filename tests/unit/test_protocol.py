"""The wire: mutual authentication, per-frame MACs, sequencing, limits. No TensorFlow."""
from __future__ import annotations

import socket
import struct
import threading

import numpy as np
import pytest

from nbdist.wire import protocol


def pair(secret_server: bytes, secret_client: bytes):
    a, b = socket.socketpair()
    result = {}

    def serve():
        try:
            result["server"] = protocol.server_handshake(a, secret_server, timeout=5)
        except Exception as exc:
            result["server_error"] = exc
            a.close()  # as the coordinator does: the client sees the refusal now, not at its timeout

    t = threading.Thread(target=serve)
    t.start()
    try:
        client = protocol.client_handshake(b, secret_client, timeout=5)
    except Exception as exc:
        client = exc
    t.join(10)
    return result.get("server", result.get("server_error")), client


class Recorder:
    """Wraps a socket and keeps a copy of everything sent through it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sent: list[bytes] = []

    def sendall(self, data) -> None:
        self.sent.append(bytes(data))
        self.sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self.sock, name)


def test_roundtrip_json_and_arrays():
    secret = protocol.new_secret()
    server, client = pair(secret, secret)
    arrays = [np.arange(12, dtype=np.float32).reshape(3, 4), np.array([1, 2, 3], dtype=np.int64),
              np.zeros((0, 5), dtype=np.float32), np.array(3.5, dtype=np.float32),
              np.asfortranarray(np.arange(6.0).reshape(2, 3))]
    client.send({"type": "hello", "rank": 1}, arrays)
    msg = server.recv()
    assert msg.body == {"type": "hello", "rank": 1}
    for got, want in zip(msg.arrays, arrays):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(got, want)
    server.send({"type": "ack"})
    assert client.recv().type == "ack"


def test_large_array_crosses_in_several_frames(monkeypatch):
    monkeypatch.setattr(protocol, "CHUNK", 1000)
    secret = protocol.new_secret()
    server, client = pair(secret, secret)
    big = np.random.default_rng(0).random(10_000)
    t = threading.Thread(target=client.send, args=({"type": "x"}, [big]))
    t.start()
    got = server.recv().arrays[0]
    t.join()
    np.testing.assert_array_equal(got, big)


def test_wrong_secret_is_rejected_both_ways():
    server, client = pair(b"a" * 32, b"b" * 32)
    assert isinstance(server, protocol.ProtocolError)
    assert isinstance(client, Exception)


def test_forged_frame_is_rejected():
    secret = protocol.new_secret()
    server, client = pair(secret, secret)
    payload = b'{"type":"hello"}'
    header = protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, protocol.KIND_JSON, 0, len(payload))
    client.sock.sendall(header + payload + b"\0" * protocol.MAC_SIZE)
    with pytest.raises(protocol.ProtocolError, match="authentication"):
        server.recv()


def test_replayed_frame_is_rejected():
    secret = protocol.new_secret()
    server, client = pair(secret, secret)
    client.sock = recorder = Recorder(client.sock)
    client.send({"type": "one"})
    assert server.recv().type == "one"
    recorder.sock.sendall(recorder.sent[0])  # the same bytes again
    with pytest.raises(protocol.ProtocolError, match="sequence"):
        server.recv()


def test_reflected_frame_is_rejected():
    """A frame the server sent, bounced back to it, must not authenticate."""
    secret = protocol.new_secret()
    server, client = pair(secret, secret)
    server.sock = recorder = Recorder(server.sock)
    server.send({"type": "job"})
    client.recv()
    client.sock.sendall(recorder.sent[0])
    with pytest.raises(protocol.ProtocolError, match="authentication"):
        server.recv()


def test_oversized_frame_is_refused_before_reading_it():
    secret = protocol.new_secret()
    server, client = pair(secret, secret)
    header = protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, protocol.KIND_JSON, 0,
                                  protocol.MAX_PAYLOAD + 1)
    client.sock.sendall(header)
    with pytest.raises(protocol.ProtocolError, match="limit"):
        server.recv()


def test_object_arrays_never_cross():
    secret = protocol.new_secret()
    _, client = pair(secret, secret)
    with pytest.raises(protocol.ProtocolError, match="numeric"):
        client.send({"type": "x"}, [np.array([object()], dtype=object)])


def test_garbage_instead_of_handshake():
    a, b = socket.socketpair()
    b.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 100)
    with pytest.raises((protocol.ProtocolError, struct.error)):
        protocol.server_handshake(a, b"s" * 32, timeout=2)


def test_zero_arrays_travel_as_their_description_and_large_ones_across_frames():
    """A fresh optimizer's slots are all zero: no bytes of theirs are sent. An array longer than a frame is
    read in place across several frames, each authenticated."""
    secret = protocol.new_secret()
    server, client = pair(secret, secret)
    recorder = Recorder(client.sock)
    client.sock = recorder
    zeros = np.zeros((300, 300), dtype=np.float32)  # 360 KB, above the 64 KiB threshold
    big = np.arange(protocol.CHUNK // 4 + 1000, dtype=np.float32)  # two frames
    small_zeros = np.zeros(10, dtype=np.float32)  # below it: sent as bytes
    nearly = np.zeros(100_000, dtype=np.float64)
    nearly[-1] = 1.0  # one nonzero element the sample misses: its bytes go
    sender = threading.Thread(target=client.send, args=({"type": "state"}, [zeros, big, small_zeros, nearly]))
    sender.start()
    msg = server.recv()
    sender.join(10)
    got_zeros, got_big, got_small, got_nearly = msg.arrays
    assert got_zeros.shape == zeros.shape and got_zeros.dtype == zeros.dtype and not got_zeros.any()
    np.testing.assert_array_equal(got_big, big)
    np.testing.assert_array_equal(got_small, small_zeros)
    np.testing.assert_array_equal(got_nearly, nearly)
    sent = sum(len(b) for b in recorder.sent)
    assert big.nbytes + nearly.nbytes < sent < big.nbytes + nearly.nbytes + 4096  # no byte of the zero array
    got_big[0] = 7.0  # the received array is writable memory of its own


def test_a_tampered_array_frame_is_refused():
    secret = protocol.new_secret()
    server, client = pair(secret, secret)
    data = np.arange(100_000, dtype=np.float32)  # large: its payload goes in a sendall of its own
    real = client.sock

    class Flip(Recorder):
        def sendall(self, data_) -> None:
            raw = bytearray(data_)
            if len(raw) == data.nbytes:  # the array's frame: one bit flipped on the way
                raw[100] ^= 1
            real.sendall(bytes(raw))

    client.sock = Flip(real)
    threading.Thread(target=client.send, args=({"type": "state"}, [data])).start()
    with pytest.raises(protocol.ProtocolError, match="authentication"):
        server.recv()
