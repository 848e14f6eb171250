"""R6: forged, truncated, oversized, bit-flipped and replayed frames against a LIVE coordinator.

A real 2-worker run trains on digits while hypothesis throws at least 2,000 hostile connections
at its coordinator (loopback only; ``make test-full`` throws 10,000: ``NBDIST_FUZZ_FRAMES``).
Each connection must be rejected (the coordinator's ``rejected`` counter counts every one,
``accepted`` stays at the two real workers), nothing crashes, and the run finishes with the
accuracy of the same run without the attack.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import queue
import socket
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nbdist.api import FitCall, prepare_fit
from nbdist.config import TrainConfig
from nbdist.wire import protocol

from ..conftest import mlp, wait_no_workers

FRAMES = int(os.environ.get("NBDIST_FUZZ_FRAMES", "2000"))
BUDGET = 60.0  # seconds for the whole attack
EPOCHS = max(40, FRAMES // 50)  # training under attack reaches about one epoch per 50 connections
HOLD_FROM = EPOCHS - 10  # from this epoch on, the run waits for the attack to end (see _holder)
SENDERS = 4


def _config() -> TrainConfig:
    return TrainConfig(epochs=EPOCHS, workers=2, batch_size=32, seed=7, ui="none")


# -- the attacker's side of the wire ---------------------------------------------
def _open(address) -> socket.socket:
    sock = socket.create_connection(address, timeout=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    return sock


def _read_hello(sock: socket.socket) -> bytes:
    data = b""
    while len(data) < protocol._HELLO.size:
        chunk = sock.recv(protocol._HELLO.size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return protocol._HELLO.unpack(data)[2]


def _handshake(sock: socket.socket, secret: bytes) -> bytes:
    """Complete a real handshake (as a peer that knows the secret); return the session key."""
    server_nonce = _read_hello(sock)
    client_nonce = os.urandom(protocol.NONCE_SIZE)
    proof = hmac.new(secret, b"client" + server_nonce + client_nonce, hashlib.sha256).digest()
    sock.sendall(protocol._CLIENT.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, client_nonce, proof))
    got = b""
    while len(got) < protocol.MAC_SIZE:
        chunk = sock.recv(protocol.MAC_SIZE - len(got))
        if not chunk:
            raise ConnectionError("closed")
        got += chunk
    return protocol._session_key(secret, server_nonce, client_nonce)


def _frame(key: bytes, payload: bytes, seq: int = 0, kind: int = protocol.KIND_JSON,
           version: int = protocol.PROTOCOL_VERSION, length: int | None = None, magic: bytes = protocol.MAGIC) -> bytes:
    header = protocol.HEADER.pack(magic, version, kind, seq, len(payload) if length is None else length)
    return header + payload + protocol._mac(key, b"C", header, payload)


def _hello(rank) -> bytes:
    return json.dumps({"type": "hello", "rank": rank, "pid": 1, "host": "fuzz"}).encode()


# First messages the coordinator must refuse though they authenticate (wire/reports.py's Hello is rank, pid, host).
MALFORMED_HELLOS = [
    {"type": "hello", "rank": 0}, {"type": "hello", "rank": 0, "pid": "1", "host": "fuzz"},
    {"type": "hello", "rank": True, "pid": 1, "host": "fuzz"}, {"type": "hello", "rank": 0, "pid": 1, "host": 7},
    {"type": "hello", "rank": 0, "pid": 1, "host": "fuzz", "extra": 1},
    {"type": "hello", "rank": 0, "pid": 1, "host": "fuzz", "arrays": {"x": 1}},
    {"type": "epoch", "epoch": 0, "logs": {}, "samples": 1, "val_samples": 0, "seconds": 0.1},
    {"type": "done"}, {"type": "no-such-type"}, {"rank": 0, "pid": 1, "host": "fuzz"},
]


class Attacker:
    """Sends one hostile connection per call; counts them."""

    def __init__(self, address, secret: bytes) -> None:
        self.address = address
        self.secret = secret
        self.sent = 0
        self._lock = threading.Lock()
        self.captured: bytes | None = None  # a valid frame from an earlier session, for replays

    def __call__(self, case: tuple) -> None:
        what, a, b = case
        try:
            with _open(self.address) as sock:
                with self._lock:
                    self.sent += 1
                self._send(sock, what, a, b)
        except OSError:
            pass  # the coordinator hung up on us first: that is a rejection too

    def _send(self, sock: socket.socket, what: str, a, b) -> None:
        if what == "garbage-handshake":  # no secret: random bytes where the proof goes
            _read_hello(sock)
            sock.sendall(a)
            return
        if what == "wrong-proof":
            _read_hello(sock)
            sock.sendall(protocol._CLIENT.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, a[:32].ljust(32, b"\0"),
                                               b[:32].ljust(32, b"\0")))
            return
        if what == "wrong-secret":  # a full handshake with a different secret
            _handshake(sock, a[:32].ljust(32, b"\1"))
            return
        key = _handshake(sock, self.secret)
        if what == "forged-mac":
            frame = _frame(a[:32].ljust(32, b"\2"), _hello(0))
        elif what == "bit-flip":
            frame = bytearray(_frame(key, _hello(0)))
            frame[a % len(frame)] ^= 1 << (b % 8)
            frame = bytes(frame)
        elif what == "truncated":
            full = _frame(key, _hello(0))
            frame = full[: a % len(full)]
        elif what == "oversized":
            frame = _frame(key, b"{}", length=protocol.MAX_PAYLOAD + 1 + a)
        elif what == "bad-version":
            frame = _frame(key, _hello(0), version=(protocol.PROTOCOL_VERSION + 1 + a) % 256)
        elif what == "bad-magic":
            frame = _frame(key, _hello(0), magic=(a[:4] + b"XXXX")[:4] if a[:4] != protocol.MAGIC else b"XXXX")
        elif what == "out-of-sequence":
            frame = _frame(key, _hello(0), seq=1 + a)
        elif what == "blob-first":
            frame = _frame(key, b"\0" * 8, kind=protocol.KIND_BLOB)
        elif what == "not-json":
            frame = _frame(key, a)
        elif what == "taken-rank":  # authenticated, well formed, but rank 0/1 is already training
            frame = _frame(key, _hello(a % 2))
        elif what == "bad-rank":
            frame = _frame(key, _hello([-1, 2, 99, "0", None, 1.5][a % 6]))
        elif what == "malformed-hello":  # authenticated, a valid frame, but not a hello this side can read
            frame = _frame(key, json.dumps(MALFORMED_HELLOS[a % len(MALFORMED_HELLOS)]).encode())
        elif what == "replay":
            frame = self.captured or _frame(key, _hello(0))
            self.captured = _frame(key, _hello(0))  # valid in this session only: replayed in a later one
        else:
            raise AssertionError(what)
        sock.sendall(frame)


_bytes = st.binary(min_size=0, max_size=120)
cases = st.one_of(
    st.tuples(st.just("garbage-handshake"), st.binary(min_size=1, max_size=200), st.none()),
    st.tuples(st.just("wrong-proof"), _bytes, _bytes),
    st.tuples(st.just("wrong-secret"), st.binary(min_size=32, max_size=32), st.none()),
    st.tuples(st.just("forged-mac"), st.binary(min_size=32, max_size=32), st.none()),
    st.tuples(st.sampled_from(["bit-flip"]), st.integers(0, 10_000), st.integers(0, 7)),
    st.tuples(st.just("truncated"), st.integers(0, 10_000), st.none()),
    st.tuples(st.just("oversized"), st.integers(0, 2**31), st.none()),
    st.tuples(st.sampled_from(["bad-version", "out-of-sequence", "taken-rank", "bad-rank", "replay",
                               "malformed-hello"]),
              st.integers(0, 250), st.none()),
    st.tuples(st.just("bad-magic"), st.binary(min_size=4, max_size=4), st.none()),
    st.tuples(st.just("not-json"), _bytes, st.none()),
    st.tuples(st.just("blob-first"), st.none(), st.none()),
)


def _accuracy(model, x, y) -> float:
    return float((model.predict(x, verbose=0).argmax(1) == y).mean())


def _holder(attack_over: threading.Event):
    """A notebook callback (the driver's side) that holds the last epochs until the attack is over.

    The workers wait for its decision at every epoch's end, so the run cannot end before the attack,
    however fast they train; it holds nothing before HOLD_FROM, so most of the attack meets live training.
    """
    import keras

    class HoldLastEpochs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch + 1 >= HOLD_FROM:
                attack_over.wait(BUDGET + 60)

    return HoldLastEpochs()


def _run(x, y, during=None):
    model = mlp(seed=3)
    underway, attack_over = threading.Event(), threading.Event()
    if during is None:
        attack_over.set()

    def listener(kind, state, payload):
        # Every worker holds its rank: a "taken-rank" hello must meet a rank in use, not take a free one.
        if kind == "progress" and all(w.state in ("training", "synchronising") for w in state.workers):
            underway.set()

    config = _config()
    fit = FitCall(x=x, y=y, epochs=EPOCHS, callbacks=[_holder(attack_over)])
    job = prepare_fit(model, config, fit, None, listeners=[listener])
    job.start()
    job.run_in_background()  # the pump runs on a thread; this one attacks
    result = None
    if during is not None:
        assert underway.wait(300), "training never started"
        try:
            result = during(job)
        finally:
            attack_over.set()
    job.wait(timeout=600)
    return job, model, result


@pytest.mark.timeout(900)
def test_hostile_frames_against_a_live_run(digits_split):
    x, xt, y, yt = digits_split
    base_job, base_model, _ = _run(x, y)
    baseline = _accuracy(base_model, xt, yt)

    def attack(job):
        coordinator = job._coordinator
        attacker = Attacker(coordinator.address, coordinator.secret)
        start = time.monotonic()

        todo: queue.Queue = queue.Queue(maxsize=256)

        def sender():  # a few connections in flight at once: each waits on the server's replies
            while (case := todo.get()) is not None:
                if time.monotonic() - start < BUDGET and job.status == "running":
                    attacker(case)

        senders = [threading.Thread(target=sender, daemon=True) for _ in range(SENDERS)]
        for t in senders:
            t.start()

        @settings(max_examples=FRAMES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(cases)
        def send(case):
            todo.put(case)

        send()
        for _ in senders:
            todo.put(None)
        for t in senders:
            t.join(BUDGET + 30)
        took = time.monotonic() - start
        if job.status == "running":  # else the run ended first and the assertion on `sent` says so
            with _open(coordinator.address) as sock:  # the accept loop survived the flood
                _read_hello(sock)
            attacker.sent += 1  # that probe is rejected too (it never answers the challenge)
        deadline = time.monotonic() + 30  # each rejection lands on its connection's thread
        while coordinator.rejected < attacker.sent and time.monotonic() < deadline:
            time.sleep(0.05)
        epochs = len(job.history.get("loss", []))
        return attacker.sent, coordinator.rejected, coordinator.accepted, took, epochs

    job, model, (sent, rejected, accepted, took, epochs) = _run(x, y, attack)
    print(f"fuzz: {sent} hostile connections in {took:.1f} s (epoch {epochs} of {EPOCHS} by then); "
          f"rejected {rejected}, accepted {accepted}")
    assert sent >= FRAMES, f"only {sent} connections within {BUDGET} s while the run was in progress"
    assert rejected == sent and accepted == 2
    assert job.status == "done" and len(job.history["loss"]) == EPOCHS
    assert abs(_accuracy(model, xt, yt) - baseline) <= 0.02, (baseline, _accuracy(model, xt, yt))
    assert not wait_no_workers(5)
