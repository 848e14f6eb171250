"""The driver-worker contract (nbdist/wire/messages.py): every job kind survives the wire as it was sent,
and a worker refuses a job it cannot read in one sentence, before using any of it."""
from __future__ import annotations

import dataclasses
import socket

import numpy as np
import pytest

from nbdist.config import TrainConfig
from nbdist.model.spec import ModelSpec
from nbdist.wire import protocol
from nbdist.wire.messages import (
    DATA_FIELDS,
    JOB_VERSION,
    JobMessage,
    MessageError,
    MessageType,
    Placement,
    TrainSettings,
)

rng = np.random.default_rng(0)


def _spec(optimizer: bool = True, graph: bytes = b"\x80\x05opaque pickled bytes") -> ModelSpec:
    return ModelSpec(graph=graph,
                     weights=[rng.normal(size=(4, 3)).astype("float32"), rng.normal(size=(3,)).astype("float32")],
                     optimizer_weights=[rng.normal(size=(4, 3)).astype("float32")] if optimizer else None,
                     layout=[[0, 1]], settings={"dtype_policy": "float32"})


def _training_job() -> JobMessage:
    cfg = TrainConfig(epochs=3, batch_size=16, seed=7, strategy="allreduce", engine="gloo")
    return JobMessage(
        kind="train", rank=1, world_size=2, batch_size=16, heartbeat_timeout=60.0, threads=1, model=_spec(),
        x=rng.normal(size=(10, 4)).astype("float32"), y=rng.integers(0, 3, size=10),
        x_val=rng.normal(size=(5, 4)).astype("float32"), y_val=rng.integers(0, 3, size=5),
        train=TrainSettings.from_config(cfg, rounds_per_epoch=2, initial_epoch=1),
        placement=Placement("127.0.0.1", "127.0.0.1", "lo", False))


def _fit_job() -> JobMessage:
    """An intercepted model.fit: a two-input, two-output model's nested data, sample weights, fit's batch plan."""
    cfg = TrainConfig(epochs=4, batch_size=8)
    n, nv = 9, 4
    return JobMessage(
        kind="train", rank=0, world_size=2, batch_size=8, heartbeat_timeout=60.0, threads=1, model=_spec(),
        x={"image": rng.normal(size=(n, 2, 2)).astype("float32"), "meta": rng.normal(size=(n, 3)).astype("float32")},
        y=[rng.integers(0, 3, size=n), rng.normal(size=(n, 1)).astype("float32")],
        sample_weight=rng.random(n).astype("float32"),
        x_val={"image": rng.normal(size=(nv, 2, 2)).astype("float32"),
               "meta": rng.normal(size=(nv, 3)).astype("float32")},
        y_val=[rng.integers(0, 3, size=nv), rng.normal(size=(nv, 1)).astype("float32")],
        sample_weight_val=rng.random(nv).astype("float32"),
        train=TrainSettings.from_config(cfg, rounds_per_epoch=3, validation_anywhere=True, batch_sizes=[5, 4],
                                        learning_rate=0.01, epoch_decisions=True),
        placement=Placement("127.0.0.1", "127.0.0.1", "lo", False))


def _evaluation_job() -> JobMessage:
    return JobMessage(kind="evaluate", rank=0, world_size=2, batch_size=256, heartbeat_timeout=30.0, threads=2,
                      model=_spec(optimizer=False), x=rng.normal(size=(6, 4)).astype("float32"),
                      y=rng.integers(0, 3, size=6),
                      classifier={"kind": "multiclass", "classes": 3, "sparse_labels": True})


def _prediction_job() -> JobMessage:
    return JobMessage(kind="predict", rank=1, world_size=2, batch_size=256, heartbeat_timeout=30.0, threads=2,
                      model=_spec(optimizer=False), x=rng.normal(size=(6, 4)).astype("float32"))


def _over_the_wire(body: dict, arrays: list[np.ndarray]) -> protocol.Message:
    """Send through a real authenticated channel pair, as the coordinator and a worker do."""
    a, b = socket.socketpair()
    secret = protocol.new_secret()
    import threading

    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("server", protocol.server_handshake(a, secret)))
    t.start()
    client = protocol.client_handshake(b, secret)
    t.join()
    try:
        box["server"].send(body, arrays)
        return client.recv()
    finally:
        client.close()
        box["server"].close()


def _assert_same(got: JobMessage, sent: JobMessage) -> None:
    for f in dataclasses.fields(JobMessage):
        want, have = getattr(sent, f.name), getattr(got, f.name)
        if f.name == "model":
            for mf in dataclasses.fields(ModelSpec):
                w, h = getattr(want, mf.name), getattr(have, mf.name)
                if isinstance(w, list) and w and isinstance(w[0], np.ndarray):
                    assert len(h) == len(w) and all(np.array_equal(p, q) and p.dtype == q.dtype for p, q in zip(h, w))
                else:
                    assert h == w, mf.name
        elif f.name in DATA_FIELDS and want is not None:
            _same_struct(have, want, f.name)
        else:
            assert have == want, f.name


def _same_struct(have, want, name: str) -> None:
    if isinstance(want, dict):
        assert isinstance(have, dict) and list(have) == list(want), name
        for k in want:
            _same_struct(have[k], want[k], f"{name}[{k}]")
    elif isinstance(want, list):
        assert isinstance(have, list) and len(have) == len(want), name
        for i, (h, w) in enumerate(zip(have, want)):
            _same_struct(h, w, f"{name}[{i}]")
    else:
        assert isinstance(have, np.ndarray) and np.array_equal(have, want) and have.dtype == want.dtype, name


@pytest.mark.parametrize("make", [_training_job, _fit_job, _evaluation_job, _prediction_job],
                         ids=["training", "intercepted-fit", "evaluation", "prediction"])
def test_each_job_kind_round_trips_through_an_authenticated_channel(make) -> None:
    sent = make()
    body, arrays = sent.encode()
    assert body["type"] == MessageType.JOB and body["version"] == JOB_VERSION
    msg = _over_the_wire(body, arrays)
    assert msg.type == MessageType.JOB
    _assert_same(JobMessage.decode(msg.body, msg.arrays), sent)


def test_the_model_graph_stays_opaque_bytes() -> None:
    body, arrays = _training_job().encode()
    assert body["model"]["graph"] == {"bytes": True}
    # The pickled model comes first as raw uint8, then weights (2) and optimizer state (1): nothing is unpickled here.
    assert arrays[0].dtype == np.uint8 and arrays[0].tobytes() == b"\x80\x05opaque pickled bytes"
    assert JobMessage.decode(body, arrays).model.graph == b"\x80\x05opaque pickled bytes"


def test_every_model_spec_field_travels_without_a_list_here(monkeypatch) -> None:
    # A field added to ModelSpec (issue 16 adds some) crosses the wire with no change to messages.py.
    @dataclasses.dataclass
    class WiderSpec(ModelSpec):
        build_input: np.ndarray | None = None
        fit_kwargs: dict | None = None

    import nbdist.wire.messages as messages

    monkeypatch.setattr(messages, "ModelSpec", WiderSpec)
    spec = WiderSpec(**dataclasses.asdict(_spec()), build_input=np.arange(4.0), fit_kwargs={"class_weight": {"0": 2}})
    job = dataclasses.replace(_prediction_job(), model=spec)
    got = JobMessage.decode(*job.encode()).model
    assert np.array_equal(got.build_input, spec.build_input) and got.fit_kwargs == {"class_weight": {"0": 2}}


def test_task_data_sends_no_rows_but_says_it_has_labels() -> None:
    job = dataclasses.replace(_training_job(), x=None, y=None, data_source="task", has_y=True)
    body, arrays = job.encode()
    got = JobMessage.decode(body, arrays)
    assert got.x is None and got.y is None and got.has_y and got.data_source == "task"
    assert got.x_val is not None and len(arrays) == 2 + 1 + 1 + 2  # weights, optimizer, blob, validation


def test_an_unknown_version_is_refused_in_one_sentence() -> None:
    body, arrays = _training_job().encode()
    body["version"] = JOB_VERSION + 1
    with pytest.raises(MessageError) as err:
        JobMessage.decode(body, arrays)
    text = str(err.value)
    assert text == (f"this worker speaks job message version {JOB_VERSION} but the driver sent {JOB_VERSION + 1}; "
                    "run the same nbdist version on the notebook and the workers.")
    assert "\n" not in text


@pytest.mark.parametrize("breakage", [
    "missing version", "missing rank", "an array short", "an array too many", "not a job", "unknown model field",
    "unknown data array", "unknown kind", "bad train settings",
])
def test_a_malformed_job_is_refused_in_one_sentence(breakage: str) -> None:
    body, arrays = _training_job().encode()
    if breakage == "missing version":
        del body["version"]
    elif breakage == "missing rank":
        del body["rank"]
    elif breakage == "an array short":
        arrays = arrays[:-1]
    elif breakage == "an array too many":
        arrays = arrays + [np.zeros(1)]
    elif breakage == "not a job":
        body["type"] = MessageType.EPOCH
    elif breakage == "unknown model field":
        body["model"]["mystery"] = {"json": 1}
    elif breakage == "unknown data array":
        body["data"]["layout"]["z"] = "array"
    elif breakage == "unknown kind":
        body["kind"] = "finetune"
    elif breakage == "bad train settings":
        body["train"]["warp_speed"] = 9
    with pytest.raises(MessageError) as err:
        JobMessage.decode(body, arrays)
    assert "\n" not in str(err.value) and str(err.value).strip()


def test_train_settings_name_only_train_config_fields() -> None:
    # TrainSettings.from_config copies by name: a renamed TrainConfig field must fail here, not on a worker.
    run_fields = {"rounds_per_epoch", "initial_epoch", "validation_anywhere", "batch_sizes", "learning_rate",
                  "epoch_decisions", "weights_every_epoch", "validation_freq", "steps_per_epoch", "first_pass",
                  "first_batch", "validation_on_tasks", "swap_ema", "raise_on_nan", "batch_summaries",
                  "elastic", "generation", "resume_step"}
    assert {f.name for f in dataclasses.fields(TrainSettings)} - run_fields <= TrainConfig.field_names()


def test_message_types_are_their_wire_strings() -> None:
    assert MessageType.HELLO == "hello" and f"{MessageType.DONE}" == "done"
    assert len({t.value for t in MessageType}) == len(MessageType)
