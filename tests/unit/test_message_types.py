"""Every message type (nbdist/wire: reports.py, commands.py, the job) survives the authenticated wire as it
was sent; a tampered frame of any of them fails authentication; and a corrupted body or array list (fields
missing, mistyped or unknown, arrays missing, extra or reordered) is a MessageError in one line, never
another exception. The receiving sides' handling of one: the coordinator drops the connection naming the
protocol error, a worker's link raises it in the job's thread (which reports it)."""
from __future__ import annotations

import copy
import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nbdist.driver.coordinator import Coordinator
from nbdist.wire import protocol
from nbdist.wire.catalog import TYPES, decode_message, read
from nbdist.wire.codec import MessageError, MessageType
from nbdist.wire.commands import AsyncShared, Decision, GenerationBroken, Heartbeat, JoinAtCommit, Rendezvous, Stop
from nbdist.wire.reports import (
    AsyncPull,
    AsyncPush,
    AtCommit,
    Done,
    Epoch,
    Evaluation,
    Hello,
    Lost,
    Predictions,
    Progress,
    State,
    Store,
    TaskExit,
    TaskRows,
    TaskStarted,
    Weights,
    WorkerError,
    WorkerWarning,
)

from .test_messages import _evaluation_job, _fit_job
from .test_protocol import Recorder, pair

f32 = lambda *shape: np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)

SAMPLES = [
    Hello(1, 4242, "node-a"),
    Store("10.0.0.2", 51234),
    Progress("training", 2, 5, 10, 160, 1.5, 0.25),
    Progress("starting", epoch=0, device="CPU"),
    State("synchronising", 0.5, 2.0),
    Epoch(3, {"loss": 0.5, "val_loss": float("nan")}, 100, 20, 0.75, batch=10, batches=10, samples_done=400,
          compute_seconds=2.0, sync_seconds=0.1),
    Epoch(0, {"loss": 0.5}, 100, 0, 0.5, array_names=["f1_score"], array_logs=[f32(10)]),
    Weights(4, 12, [[0, 1]], [f32(4, 3), f32(3)], [f32(4, 3), f32(4, 3), np.array(3, np.int64)]),
    Done(tensorflow_loaded=False, device="CPU", sync_seconds=0.3, rounds=15, summed_by=None, engine="gloo",
         padded_steps=1, keras_backend="jax", optional_imports=[], last_epoch=None, learning_rates=[0.01, 0.005],
         phase_times=[{"steps": 1.0, "total": 1.2}], weights_sent=1),
    Done(seconds=0.4, tensorflow_loaded=True),
    WorkerError("ValueError", "ValueError: bad shape", "Traceback (most recent call last):\n  ...\nValueError"),
    WorkerError("ValueError", "ValueError: bad shape", "Traceback (most recent call last):\n  ...\nValueError",
                "builtins:ValueError", "bad shape\nReceived: (3,)"),
    Lost(2, 1, 7, "RuntimeError", "RuntimeError: worker 2 exited", "Traceback (most recent call last):\n  ..."),
    AtCommit(3, 2),
    WorkerWarning("--engine horovod is not installed on this worker; using gloo"),
    AsyncPull(0, True, [f32(2, 2), np.arange(3)]),
    AsyncPush(7, 3, 64, 1, [f32(2, 2)]),
    Evaluation(6, ["loss/total", "acc/count"], [f32(1), f32(1)], f32(1), f32(1, 3), np.eye(3), np.ones((2, 5))),
    Evaluation(0),
    Predictions(6, {"a": "array", "b": "array"}, [f32(6, 2), f32(6, 1)]),
    Predictions(5, "array", [f32(5, 3)], [2, 2, 1]),
    TaskStarted(0, 99, "executor-1", True),
    TaskRows(1, 500, 50),
    TaskExit(1, -9, "killed", 1.7e9, "", True, 3 * 2**30),
    Decision(2, False, 0.001),
    Decision(3, True, None),
    Rendezvous("10.0.0.2", 51234),
    Stop(weights=True),
    JoinAtCommit(3),
    GenerationBroken(3),
    AsyncShared(4, [8, 9], False, "", [f32(2, 2)]),
    AsyncShared(5, [], True, "replays an update", [f32(2, 2)]),
    Heartbeat(),
    _fit_job(),
    _evaluation_job(),
]


def _same(a, b) -> None:
    """Two messages alike: the same type, the same body (NaN equal to NaN) and arrays equal in dtype and value."""
    assert type(a) is type(b)
    (body_a, arrays_a), (body_b, arrays_b) = a.encode(), b.encode()
    assert repr(body_a) == repr(body_b)
    assert len(arrays_a) == len(arrays_b)
    for x, y in zip(arrays_a, arrays_b):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


def test_every_message_type_has_a_sample_and_a_class() -> None:
    assert set(TYPES) == {t.value for t in MessageType}
    assert {type(m).TYPE for m in SAMPLES} == set(MessageType)


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_each_message_round_trips_through_an_authenticated_channel(message) -> None:
    secret = protocol.new_secret()
    server, client = pair(secret, secret)
    try:
        body, arrays = message.encode()
        sender = threading.Thread(target=client.send, args=(body, arrays))
        sender.start()
        got = read(server.recv())
        sender.join(10)
        _same(got, message)
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_a_tampered_frame_of_each_message_is_refused(message) -> None:
    secret = protocol.new_secret()
    server, client = pair(secret, secret)
    real = client.sock

    class FlipFirstFrame(Recorder):
        def sendall(self, data) -> None:
            raw = bytearray(data)
            if not self.sent:  # the body's frame: one bit of its JSON flipped on the way
                raw[protocol.HEADER.size + 3] ^= 1
            self.sent.append(bytes(raw))
            real.sendall(bytes(raw))

    client.sock = FlipFirstFrame(real)

    def send() -> None:
        try:
            client.send(*message.encode())
        except OSError:
            pass  # the receiver hung up on the forged frame before the arrays' frames went

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    try:
        with pytest.raises(protocol.ProtocolError, match="authentication"):
            server.recv()
    finally:
        server.close()
        sender.join(10)
        real.close()


# -- corruption ---------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6)
arrays_st = st.sampled_from([np.zeros(0), np.arange(3), np.ones((2, 2), np.float32), np.array("x"),
                             np.zeros((1, 0)), np.array([True])])


def _places(node, out: list) -> list:
    """Every (container, key) in a body, nested ones included."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        out.append((node, key))
        _places(value, out)
    return out


@st.composite
def corrupted(draw):
    message = draw(st.sampled_from(SAMPLES))
    body, arrays = message.encode()
    body, arrays = copy.deepcopy(body), list(arrays)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["replace", "delete", "add", "retype", "drop-array", "add-array",
                                    "swap-array", "counts"]))
        places = _places(body, [])
        if how in ("replace", "delete") and places:
            node, key = places[draw(st.integers(0, len(places) - 1))]
            if how == "replace":
                node[key] = draw(json_values)
            elif isinstance(node, dict):
                del node[key]
            else:
                node.pop(key)
        elif how == "add":
            body[draw(st.text(max_size=6))] = draw(json_values)
        elif how == "retype":
            body["type"] = draw(st.sampled_from([t.value for t in MessageType] + ["", "nope", 3]))
        elif how == "drop-array" and arrays:
            arrays.pop(draw(st.integers(0, len(arrays) - 1)))
        elif how == "add-array":
            arrays.insert(draw(st.integers(0, len(arrays))), draw(arrays_st))
        elif how == "swap-array" and arrays:
            arrays[draw(st.integers(0, len(arrays) - 1))] = draw(arrays_st)
        elif how == "counts":
            body["arrays"] = draw(json_values)
    return body, arrays


@settings(max_examples=3000, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(corrupted())
def test_a_corrupted_message_is_a_clean_protocol_error(case) -> None:
    body, arrays = case
    try:
        message = decode_message(body, arrays)
    except MessageError as exc:
        text = str(exc)
        assert text and "\n" not in text and len(text) < 400, text
        return
    message.encode()  # what was read is a whole message: it can be sent on as it is


@pytest.mark.parametrize("body", [
    {"type": "epoch", "epoch": "3", "logs": {}, "samples": 1, "val_samples": 0, "seconds": 0.1},
    {"type": "done", "rounds": 1, "surprise": True},
    {"type": "evaluation", "rows": 1, "names": ["a"], "arrays": {"state": 2, "y_row": 0, "y_pred_row": 0,
                                                                  "confusion": 0, "histogram": 0}},
    {"type": "progress"},
    {"type": "no-such-type"},
])
def test_malformed_messages_name_what_is_wrong(body) -> None:
    with pytest.raises(MessageError) as err:
        decode_message(body, [np.zeros(1)])
    assert "\n" not in str(err.value)


def test_the_coordinator_drops_a_worker_that_sends_a_malformed_message() -> None:
    """As for any garbage from an authenticated peer: its connection closes, the event names the error."""
    coordinator = Coordinator(protocol.new_secret(), world_size=1)
    try:
        channel = protocol.connect(coordinator.address, coordinator.secret)
        channel.send(*Hello(0, 1, "here").encode())
        assert coordinator.events.get(timeout=10).kind == "connected"
        channel.send({"type": "epoch", "epoch": "three", "logs": {}, "samples": 1, "val_samples": 0, "seconds": 0})
        event = coordinator.events.get(timeout=10)
        assert event.kind == "closed" and event.detail == (
            "protocol error: malformed message: epoch.epoch is 'three', not int")
        channel.close()
    finally:
        coordinator.close()


def test_a_malformed_command_fails_the_workers_job_thread_not_its_reader() -> None:
    from nbdist.worker.main import DriverLink

    secret = protocol.new_secret()
    driver, worker = pair(secret, secret)
    # In pytest's own process: a heartbeat that found the driver silent would end it (os._exit), so none beats.
    link = DriverLink(worker, heartbeat_interval=3600.0, heartbeat_timeout=7200.0)
    try:
        driver.send({"type": "decision", "epoch": 0, "stop": "yes"})
        with pytest.raises(MessageError, match="decision.stop"):
            link.expect(Decision, timeout=10)
        driver.send(*Decision(0, True, None).encode())  # the reader lives on
        assert link.expect(Decision, timeout=10).stop
    finally:
        worker.closed = True  # the reader then ends quietly instead of exiting the process
        driver.close()
        worker.close()
        time.sleep(0.05)
