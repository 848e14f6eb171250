"""The contract between the driver and its workers: the job message, and the version of every message.

protocol.py moves authenticated JSON bodies and arrays; codec.py, this module, reports.py (worker -> driver)
and commands.py (driver -> worker) say what they mean; catalog.py reads any of them. The job message (driver
-> worker, once per worker and run) is typed and versioned: ``JobMessage.encode()`` gives the JSON body and
the arrays in the order ``decode`` reads them back. ``JOB_VERSION`` changes whenever a field is added,
removed or changes meaning; a worker refuses another version in one sentence. The model travels as every
field of ``ModelSpec``, each encoded by its value, so a new field crosses with no change here; the
cloudpickled custom objects stay opaque bytes that only the worker opens, after authentication.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from ..data.structures import Struct, flatten, unflatten
from ..model.spec import ModelSpec
from .codec import MessageError, MessageType

# Bump on any change to the fields or meaning of any message (this job's, wire/reports.py's, wire/commands.py's):
# the job carries it and a worker of another version refuses the job. 5: every message typed; 6: engine fields;
# 7: elastic runs (TrainSettings.elastic, generation; the Lost report); 8: workers joining (JoinAtCommit, AtCommit;
# a Lost with committed -1); 9: commits every K steps (TrainSettings.commit_every, resume_step; Lost and AtCommit's
# step); 10: GenerationBroken.
JOB_VERSION = 10

JOB_KINDS = ("train", "evaluate", "predict")
# The shard came in the job's arrays / the Spark task wrote it to a file / the worker reads its rows of
# the notebook's memory-mapped .npy file (``data_file``; local workers, which share the filesystem).
DATA_SOURCES = ("wire", "task", "file")
# A job's data fields, in the order their arrays follow the model's. Each is an array, a nested
# dict/list of arrays (a multi-input or multi-output model's), or None.
DATA_FIELDS = ("x", "y", "sample_weight", "x_val", "y_val", "sample_weight_val")


@dataclass
class BatchSummaries:
    """The part of the notebook's ``keras.callbacks.TensorBoard`` that happens inside the passes, written by
    worker 0 into the same ``log_dir`` (driver/callbacks.py): per-batch scalars (``update_freq`` a number of
    batches, 0 for "epoch"), the model's own ``tf.summary`` calls, the profiled batches and the train graph."""

    log_dir: str
    update_freq: int
    profile_batch: list[int]  # [first, last] global batch; [0, 0]: none
    write_steps_per_second: bool
    write_graph: bool

    @property
    def per_batch(self) -> bool:
        """Whether it acts at every batch (the worker then runs one step per call, as Keras does)."""
        return self.update_freq > 0 or self.profile_batch != [0, 0]


@dataclass
class TrainSettings:
    """What only a training job needs, besides the model and the data."""

    epochs: int
    averaging_frequency: int
    average_optimizer: bool
    seed: int | None
    shuffle: bool
    lr_scaling: str
    strategy: str
    engine: str | None
    direct_sum_bytes: int
    shared_memory: bool
    shared_chunk_bytes: int
    device_sum: str  # machine/engines.py: where tensors are summed (auto, always, never)
    overlap: bool
    bucket_bytes: int
    sync_timeout: float
    startup_timeout: float
    rounds_per_epoch: int  # averaging rounds every worker runs per epoch (uneven shards pad to the longest)
    initial_epoch: int = 0  # > 0 when resumed or restarted from a checkpoint
    # Workers without validation rows still join each epoch's sum of validation metric state.
    validation_anywhere: bool = False
    # An intercepted model.fit (driver/fit_call.py): each rank's share of the global batch (None:
    # batch_size on every rank), the first epoch's learning rate chosen by the notebook's
    # callbacks, and whether every epoch ends waiting for their DECISION.
    batch_sizes: list[int] | None = None
    learning_rate: float | None = None
    epoch_decisions: bool = False
    validation_freq: int = 1  # fit's validation_freq: the workers validate every that many epochs
    # fit's steps_per_epoch (None: an epoch is one pass over the shard): each epoch reads that many
    # batches where the last one stopped; the pipeline starts at batch ``first_batch`` of pass
    # ``first_pass`` (counted as epochs are without it: its shuffle seed), not rewound per epoch.
    steps_per_epoch: int | None = None
    first_pass: int = 0
    first_batch: int = 0
    # Rank 0 sends the weights at every epoch end (checkpoints, callbacks that read the model);
    # False: once, at the end or when the driver stops the run (driver/training.py decides).
    weights_every_epoch: bool = True
    # Spark data: the bytes of rows a worker holds and shuffles together while streaming (worker/streams.py).
    stream_buffer_bytes: int = 64 * 2**20
    fused_updates: bool | None = None  # Adam/SGD updates as fused kernels (TrainConfig, strategies/fused_updates.py)
    # A validation DataFrame: each task wrote this worker's share of it beside its training rows, streamed too.
    validation_on_tasks: bool = False
    # The notebook's callbacks that act inside the workers' passes (driver/callbacks.py): SwapEMAWeights (the
    # moving averages swapped in around each validation) and TerminateOnNaN(raise_error=True) (Keras' error
    # at the batch).
    swap_ema: bool = False
    raise_on_nan: bool = False
    # The notebook's TensorBoard's part inside the passes, run by worker 0 (None: nothing to write there).
    batch_summaries: BatchSummaries | None = None
    phase_times: bool = False  # each worker times every epoch's phases (TrainConfig, worker/phases.py)
    # An elastic run (TrainConfig.min_workers, worker/elastic.py): a broken collective is reported (Lost) and the
    # worker waits for the job of the next generation (a new world, ranks and shard), which keeps its model as it
    # holds it, rolled back to its last commit. ``generation`` counts the membership changes so far.
    elastic: bool = False
    generation: int = 0
    # Commit every ``commit_every`` optimizer steps as well as at each epoch start (None: at epoch starts only).
    # ``resume_step`` > 0: this generation resumes ``initial_epoch`` after that many of its steps (a rollback to a
    # mid-epoch commit): the worker first trains the rest of that epoch, its rows from that step on.
    commit_every: int | None = None
    resume_step: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.batch_summaries, dict):  # as it crosses the wire
            self.batch_summaries = BatchSummaries(**self.batch_summaries)

    @property
    def step_by_step(self) -> bool:
        """A notebook's callback acts at every batch on the workers: one step per call into the backend."""
        return self.raise_on_nan or (self.batch_summaries is not None and self.batch_summaries.per_batch)

    @classmethod
    def from_config(cls, config: Any, **run: Any) -> TrainSettings:
        """The settings TrainConfig holds, by name, plus the run's own (``run``)."""
        held = {f.name for f in dataclasses.fields(config)}
        names = {f.name for f in dataclasses.fields(cls) if f.name in held} - set(run)
        return cls(**{name: getattr(config, name) for name in names}, **run)


@dataclass
class Placement:
    """Where a training job's collective listens and how peers reach it."""

    bind_host: str
    advertise_host: str
    gloo_ifname: str | None = None
    # Rank 0 binds the store on its own connection's address (a Spark executor), not advertise_host.
    store_on_link: bool = False
    # How the workers meet: "torch" (a TCPStore and a Gloo group), or "host" (every worker on this machine
    # and no torch: a directory in /dev/shm and shared-memory sums, strategies/host_collective.py).
    meet: str = "torch"


@dataclass
class JobMessage:
    """One worker's job: what to run (``kind``), on which model and data, with which settings."""

    TYPE: ClassVar[MessageType] = MessageType.JOB

    kind: str  # "train" | "evaluate" | "predict"
    rank: int
    world_size: int
    batch_size: int
    heartbeat_timeout: float
    threads: int  # TensorFlow's intra-op threads on this worker
    model: ModelSpec
    x: Struct = None  # None when data_source is "task" (until the worker loads its file)
    y: Struct = None
    sample_weight: Struct = None
    x_val: Struct = None
    y_val: Struct = None
    sample_weight_val: Struct = None
    data_source: str = "wire"
    train: TrainSettings | None = None  # kind "train" only
    placement: Placement | None = None  # kind "train" only
    classifier: dict[str, Any] | None = None  # kind "evaluate": ClassifierSpec.to_json()
    version: int = JOB_VERSION
    # True when the data carries labels; for data_source "task" the body says so, as no arrays come.
    has_y: bool = field(default=False)
    # A fit on keras.utils.PyDataset(s): cloudpickled {"train", "validation": data.PyDatasetData or None,
    # "order_seed": int}; evaluation or prediction on one: {"inference": data.PyDatasetData}. Each worker
    # reads its share of the batches (worker/pydatasets.py).
    py_datasets: bytes | None = None
    # data_source "file": {"path", "offset", "dtype", "shape"} of the features' .npy plus this worker's rows,
    # "start"/"stop" or "deal" (data.NpyFile, data.file_index); the labels travel in y as usual.
    data_file: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.kind not in JOB_KINDS:
            raise MessageError(f"unknown job kind {self.kind!r}; expected one of {', '.join(JOB_KINDS)}")
        if self.data_source not in DATA_SOURCES:
            raise MessageError(f"unknown data source {self.data_source!r}; expected one of {', '.join(DATA_SOURCES)}")
        if self.kind == "train" and (self.train is None or self.placement is None):
            raise MessageError("a training job needs its train settings and placement")
        self.has_y = self.has_y or self.y is not None

    # -- driver side ----------------------------------------------------
    def encode(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        """The JSON body and the arrays: the model's arrays in field order, then the data's (DATA_FIELDS)."""
        arrays: list[np.ndarray] = []
        model = {f.name: _encode_value(getattr(self.model, f.name), arrays) for f in dataclasses.fields(ModelSpec)}
        layout = {}
        for name in DATA_FIELDS:
            layout[name], leaves = flatten(getattr(self, name))
            arrays += leaves
        body = {
            "type": MessageType.JOB.value, "version": self.version, "kind": self.kind, "rank": self.rank,
            "world_size": self.world_size, "batch_size": self.batch_size,
            "heartbeat_timeout": self.heartbeat_timeout, "threads": self.threads, "model": model,
            "data": {"source": self.data_source, "layout": layout, "has_y": self.has_y, "file": self.data_file},
            "train": None if self.train is None else dataclasses.asdict(self.train),
            "placement": None if self.placement is None else dataclasses.asdict(self.placement),
            "classifier": self.classifier,
        }
        body["py_datasets"] = _encode_value(self.py_datasets, arrays)  # after the data's arrays
        return body, arrays

    # -- worker side ----------------------------------------------------
    @classmethod
    def decode(cls, body: dict[str, Any], arrays: list[np.ndarray]) -> JobMessage:
        """The job from an authenticated message; MessageError in one sentence if it cannot be read."""
        if not isinstance(body, dict) or body.get("type") != MessageType.JOB:
            raise MessageError("expected a job message from the driver")
        version = body.get("version")
        if version != JOB_VERSION:
            raise MessageError(f"this worker speaks job message version {JOB_VERSION} but the driver sent "
                               f"{version}; run the same nbdist version on the notebook and the workers.")
        try:
            return cls._decode(body, list(arrays))
        except MessageError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise MessageError(f"malformed job message ({type(exc).__name__}: {exc}); run the same nbdist "
                               "version on the notebook and the workers.") from None

    @classmethod
    def _decode(cls, body: dict[str, Any], arrays: list[np.ndarray]) -> JobMessage:
        pending = list(arrays)
        model_body = body["model"]
        known = {f.name for f in dataclasses.fields(ModelSpec)}
        unknown = set(model_body) - known
        if unknown:
            raise MessageError(f"the job's model has field(s) {', '.join(sorted(unknown))} this worker does not "
                               "know; run the same nbdist version on the notebook and the workers.")
        model = ModelSpec(**{name: _decode_value(value, pending) for name, value in model_body.items()})
        data = body["data"]
        layout = data["layout"]
        if set(layout) != set(DATA_FIELDS):
            raise MessageError(f"the job's data has fields {sorted(layout)}, not {', '.join(DATA_FIELDS)}")
        rest = iter(pending)
        try:
            values = {name: unflatten(layout[name], rest) for name in DATA_FIELDS}
        except StopIteration:
            raise MessageError(f"the job message has {len(arrays)} arrays, fewer than its body describes") from None
        pending = list(rest)
        py_datasets = _decode_value(body.get("py_datasets"), pending)
        left = len(pending)
        if left:
            raise MessageError(f"the job message has {left} more arrays than its body describes")
        train = body.get("train")
        placement = body.get("placement")
        return cls(
            kind=str(body["kind"]), rank=int(body["rank"]), world_size=int(body["world_size"]),
            batch_size=int(body["batch_size"]), heartbeat_timeout=float(body["heartbeat_timeout"]),
            threads=int(body["threads"]), model=model, **values,
            data_source=str(data["source"]), has_y=bool(data["has_y"]), data_file=data.get("file"),
            train=None if train is None else TrainSettings(**train),
            placement=None if placement is None else Placement(**placement),
            classifier=body.get("classifier"), version=int(body["version"]), py_datasets=py_datasets,
        )


def _encode_value(value: Any, arrays: list[np.ndarray]) -> dict[str, Any] | None:
    """A ModelSpec field as a small JSON tag; its arrays (if any) appended to ``arrays``."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray)):
        arrays.append(np.frombuffer(bytes(value), dtype=np.uint8))
        return {"bytes": True}
    if isinstance(value, np.ndarray):
        arrays.append(value)
        return {"array": True}
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, np.ndarray) for v in value):
        arrays.extend(value)
        return {"arrays": len(value)}
    if isinstance(value, (list, tuple)) and not value:
        return {"arrays": 0}
    return {"json": value}


def _decode_value(tag: Any, pending: list[np.ndarray]) -> Any:
    if tag is None:
        return None
    if not isinstance(tag, dict) or len(tag) != 1:
        raise MessageError(f"the job's model has a malformed field {tag!r}")
    (how, value), = tag.items()
    if how == "json":
        return value
    if how == "bytes":
        return _take(pending, 1)[0].tobytes()
    if how == "array":
        return _take(pending, 1)[0]
    if how == "arrays":
        return _take(pending, int(value))
    raise MessageError(f"the job's model has a field of unknown encoding {how!r}")


def _take(pending: list[np.ndarray], n: int) -> list[np.ndarray]:
    if n < 0 or n > len(pending):
        raise MessageError(f"the job message has fewer arrays than its body describes ({n} more wanted, "
                           f"{len(pending)} left)")
    taken = pending[:n]
    del pending[:n]
    return taken
