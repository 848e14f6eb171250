"""What one Spark task does on its executor: write its partition, start a worker, watch it.

A task of the run's barrier stage (an ordinary stage under dynamic allocation), or in an elastic run the one task
of a worker's own job (``single_task``).

Everything here runs on the executor, so it imports only the standard library
and numpy at module level (pyspark is imported inside the task). The pure parts
(the npy writer, row conversion, the GPU mapping) are tested without Spark.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..backends.command import job_command, worker_env
from ..machine.processes import ChildEnd, ProcessId, oom_kill_count, read_log_tail, reap, signal_group
from ..wire.reports import TaskExit, TaskRows, TaskStarted
from ..wire.shardfile import DATA_ENV, VALIDATION_DIR, DiskFull, ShardWriter

log = logging.getLogger(__name__)

CHUNK_ROWS = 4096
# With a validation DataFrame the barrier stage reads the union of both, each row marked by this column.
VALIDATION_COLUMN = "__nbdist_validation"


# -- pure helpers ---------------------------------------------------------
def cuda_visible_devices(resources: Mapping[str, Any]) -> str | None:
    """CUDA_VISIBLE_DEVICES for the GPUs Spark assigned to this task, or None if it assigned none.

    ``resources`` is ``BarrierTaskContext.resources()``: name -> ResourceInformation
    (with ``.addresses``, strings such as "0"). Spark's GPU discovery script reports
    the device ordinals CUDA uses, so they map one to one. Unverified on a GPU:
    this machine has none; the mapping is unit-tested with ResourceInformation only.
    """
    info = resources.get("gpu") if resources else None
    if info is None:
        return None
    addresses = getattr(info, "addresses", info)
    return ",".join(str(a).strip() for a in addresses)


def task_visible_devices(resources: Mapping[str, Any]) -> str | None:
    """The one GPU this task's worker uses (allreduce pins one per worker); None: Spark assigned none."""
    from ..machine.placement import spark_task_visible_devices

    devices = cuda_visible_devices(resources)
    return None if devices is None else spark_task_visible_devices(devices.split(","))


def _feature_block(values: list[Any], name: str) -> np.ndarray:
    """One feature column of a block of rows as a float32 (rows, k) array."""
    first = values[0]
    try:
        if hasattr(first, "toArray"):  # pyspark.ml.linalg DenseVector / SparseVector
            return np.stack([np.asarray(v.toArray(), dtype=np.float32).ravel() for v in values])
        arr = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"column {name!r} cannot be read as numbers ({exc}); it must hold numbers, "
                         "arrays of numbers or ML vectors, with no nulls (drop them with df.na.drop()).") from None
    arr = arr.reshape(len(values), -1)
    if not np.isfinite(arr).all():  # None becomes NaN on the way in
        raise ValueError(f"column {name!r} holds nulls, NaN or infinite values; drop or fill them first "
                         "(e.g. df.na.drop()).")
    return arr


def _label_block(values: list[Any], name: str) -> np.ndarray:
    """Labels of a block of rows: (rows,) numbers, or (rows, k) for vector labels (arrays, ML Vectors)."""
    if len(values) and hasattr(values[0], "toArray"):  # pyspark.ml.linalg vectors
        return _feature_block(values, name)
    try:
        arr = np.asarray(values)
    except ValueError as exc:
        raise ValueError(f"label {name!r} cannot be read as numbers ({exc}).") from None
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if arr.dtype.kind in "fb":
        return arr.astype(np.float32)
    raise ValueError(f"label {name!r} holds {arr.dtype} values (nulls or text?); it must hold numbers.")


@dataclass(frozen=True)
class Layout:
    """How rows of a partition become (x, y): named DataFrame columns or (features, label) pairs."""

    features: tuple[str, ...] = ()  # empty: rows are (features, label) pairs
    label: str | None = None
    weight: str | None = None  # a DataFrame's column of per-row sample weights (Arrow batches only)

    def split(self, rows: list[Any]) -> tuple[np.ndarray, np.ndarray | None]:
        if not self.features:  # an RDD of (features, label)
            x = _feature_block([r[0] for r in rows], "features")
            return x, _label_block([r[1] for r in rows], "label")
        blocks = [_feature_block([r[i] for r in rows], name) for i, name in enumerate(self.features)]
        x = blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1)
        y = None
        if self.label is not None:
            y = _label_block([r[len(self.features)] for r in rows], self.label)
        return x, y


def write_partition(rows: Iterable[Any], layout: Layout, directory: str, chunk: int = CHUNK_ROWS) -> int:
    """Stream a partition's rows into ``directory``'s shard file, ``chunk`` rows a block; the row count."""
    writer = ShardWriter(directory, labels=layout.label is not None or not layout.features)
    try:
        block: list[Any] = []
        for row in rows:
            block.append(row)
            if len(block) >= chunk:
                _write_block(block, layout, writer)
                block = []
        if block:
            _write_block(block, layout, writer)
    finally:
        writer.close()
    return writer.rows


def vector_values(cell: Any) -> Any:
    """An ML Vector as Arrow hands it over (its struct: type, size, indices, values) -> dense values."""
    if not isinstance(cell, dict) or "values" not in cell:
        return cell
    values = np.asarray(cell["values"], dtype=np.float32)
    if cell.get("type") == 1:  # dense
        return values
    dense = np.zeros(int(cell["size"]), dtype=np.float32)
    dense[np.asarray(cell["indices"], dtype=np.int64)] = values
    return dense


def _list_rows(column: Any, what: str) -> np.ndarray | None:
    """A column of lists (arrays of numbers) as its (rows, k) values; None for any other column."""
    import pyarrow as pa

    kind = column.type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)):
        return None
    lengths = np.diff(np.asarray(column.offsets)) if not pa.types.is_fixed_size_list(kind) else None
    if lengths is not None and len(lengths) and (lengths != lengths[0]).any():
        raise ValueError(f"{what} has {lengths.min()} values in some rows but {lengths.max()} in others; every "
                         "row needs the same number of values.")
    return column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), -1)


def arrow_features(column: Any, name: str) -> np.ndarray:
    """One Arrow feature column (numbers, lists of numbers, ML Vector structs) as float32 (rows, k)."""
    import pyarrow as pa

    if column.null_count:
        raise ValueError(f"column {name!r} holds nulls; drop or fill them first (e.g. df.na.drop()).")
    kind = column.type
    rows = _list_rows(column, f"column {name!r}")
    if rows is not None:
        arr = np.asarray(rows, dtype=np.float32)
    elif pa.types.is_struct(kind):  # an ML Vector
        arr = _feature_block([vector_values(v) for v in column.to_pylist()], name)
    else:
        try:
            arr = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float32).reshape(len(column), 1)
        except (TypeError, ValueError, pa.ArrowException) as exc:
            raise ValueError(f"column {name!r} cannot be read as numbers ({exc}).") from None
    if not np.isfinite(arr).all():
        raise ValueError(f"column {name!r} holds NaN or infinite values; drop or fill them first.")
    return arr


def arrow_label(column: Any, name: str) -> np.ndarray:
    """A label column: numbers (rows,), or arrays of numbers or ML Vectors (one-hot, multi-label, several
    regression targets) as (rows, k), as the same labels in numpy train."""
    import pyarrow as pa

    if column.null_count:
        raise ValueError(f"label {name!r} holds nulls; drop them first (e.g. df.na.drop()).")
    kind = column.type
    rows = _list_rows(column, f"label {name!r}")
    if rows is not None:
        return _label_block(rows, name)
    if pa.types.is_struct(kind):  # an ML Vector
        return _feature_block([vector_values(v) for v in column.to_pylist()], name)
    return _label_block(column.to_numpy(zero_copy_only=False), name)


def write_batches(batches: Iterable[Any], layout: Layout, directory: str) -> int:
    """Stream a partition's Arrow record batches into ``directory``'s shard file, one block per batch
    (Spark's ``spark.sql.execution.arrow.maxRecordsPerBatch`` rows at most); the row count."""
    return write_split_batches(batches, layout, directory, validation=False)[0]


def write_split_batches(batches: Iterable[Any], layout: Layout, directory: str,
                        validation: bool) -> tuple[int, int]:
    """``write_batches``; with ``validation`` the batches also hold validation rows, marked by
    ``VALIDATION_COLUMN``, which go to the shard file under ``directory``/validation. (rows, validation rows)."""
    import pyarrow.compute as pc

    weighted = layout.weight is not None
    train = ShardWriter(directory, labels=layout.label is not None, weights=weighted)
    val = None
    if validation:
        os.makedirs(os.path.join(directory, VALIDATION_DIR), exist_ok=True)
        val = ShardWriter(os.path.join(directory, VALIDATION_DIR), labels=layout.label is not None, weights=weighted)
    try:
        for batch in batches:
            if batch.num_rows == 0:
                continue
            if val is None:
                _append_batch(train, batch, layout)
                continue
            marked = batch.column(VALIDATION_COLUMN)
            _append_batch(train, batch.filter(pc.invert(marked)), layout)
            _append_batch(val, batch.filter(marked), layout, "the validation features")
    finally:
        train.close()
        if val is not None:
            val.close()
    return train.rows, (val.rows if val is not None else 0)


def _append_batch(writer: ShardWriter, batch: Any, layout: Layout, what: str = "the features") -> None:
    if batch.num_rows == 0:
        return
    blocks = [arrow_features(batch.column(name), name) for name in layout.features]
    y = arrow_label(batch.column(layout.label), layout.label) if layout.label is not None else None
    w = arrow_weight(batch.column(layout.weight), layout.weight) if layout.weight is not None else None
    writer.append(blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=1), y, what, w)


def arrow_weight(column: Any, name: str) -> np.ndarray:
    """The weight column: one finite float32 ``sample_weight`` per row."""
    if column.null_count:
        raise ValueError(f"weight column {name!r} holds nulls; drop or fill them first (e.g. df.na.fill(1.0, "
                         f"[{name!r}])).")
    w = np.asarray(column.to_numpy(zero_copy_only=False), dtype=np.float32)
    if not np.isfinite(w).all():
        raise ValueError(f"weight column {name!r} holds NaN or infinite values; drop or fill them first.")
    return w


def _write_block(block: list[Any], layout: Layout, writer: ShardWriter) -> None:
    x, y = layout.split(block)
    writer.append(x, y)


# -- the task -------------------------------------------------------------
@dataclass(frozen=True)
class TaskSpec:
    address: tuple[str, int]  # the coordinator
    status_address: tuple[str, int]  # the backend's status listener
    secret_hex: str  # travels inside the Spark task: protect Spark RPC (spark.authenticate) on shared clusters
    threads: int  # the worker's thread budget; 0: the task's CPUs (a cluster: what Spark reserved for it)
    layout: Layout | None = None  # None: the data comes over the wire from the driver
    warm: bool = False  # take a warm worker if one waits, and leave one for the next job (warm.py)
    keras_backend: str | None = None  # the notebook's (machine/keras_backend.py), whatever the executor's
    validation: bool = False  # the partition also holds validation rows (VALIDATION_COLUMN true)
    barrier: bool = True  # False: an ordinary stage (dynamic allocation), whose retried task starts no worker


class _Reporter:
    """The task's authenticated line back to the driver: which worker it started and how it ended."""

    def __init__(self, spec: TaskSpec, secret: bytes) -> None:
        from ..wire import protocol

        self.error = ""
        try:
            self.channel: Any = protocol.connect(tuple(spec.status_address), secret, timeout=REACH_TIMEOUT)
        except Exception as exc:
            self.error = unreachable(tuple(spec.status_address), exc)
            log.warning("%s", self.error)
            self.channel = None

    def send(self, message: TaskStarted | TaskRows | TaskExit) -> None:
        if self.channel is not None:
            try:
                self.channel.send(*message.encode())
            except Exception as exc:
                log.warning("lost the driver's status channel: %s", exc)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()


def executor_id() -> tuple[int, int] | None:
    """The process that started this task's Python worker (pid, start time): the executor's side.

    Warm workers are kept per executor and end with it.
    """
    parent = ProcessId.of(os.getppid())
    return None if parent is None else (parent.pid, parent.start)


def _move(src: Path, dst: str) -> str:
    """Move a warm worker's log into the task's directory (its open file moves with it); its path."""
    try:
        os.replace(src, dst)
        return dst
    except OSError:  # another filesystem: read it where it is
        return str(src)


REACH_TIMEOUT = 10.0  # a task that cannot reach the notebook says so well within 30 s
# What each task of the DataFrame barrier stage returns (one row): the driver's fallback record.
RESULT_SCHEMA = "rank long, code long, rows long, log string, error string"


def unreachable(address: tuple[str, int], exc: BaseException) -> str:
    """The one sentence a task returns when the notebook's coordinator is out of its reach."""
    return (f"the Spark executors cannot reach the notebook at {address[0]}:{address[1]} ({exc}); run the "
            "notebook on the cluster's network, or set advertise_host (%config DistMagics.advertise_host, or the "
            "advertise_host option) to an address of this machine that the executors can reach (and open its "
            "ports to them).")


def local_dir() -> str | None:
    """Where the task writes its partition: the executor's first local directory (Spark's scratch disk,
    spark.local.dir / SPARK_LOCAL_DIRS) when it names one, else the temp directory."""
    dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d and os.path.isdir(d)]
    return dirs[0] if dirs else None


def task_context(spec: TaskSpec) -> Any:
    """This task's context: a barrier stage's, or an ordinary stage's (``spec.barrier`` False)."""
    from pyspark import BarrierTaskContext, TaskContext

    return BarrierTaskContext.get() if spec.barrier else TaskContext.get()


def retried(ctx: Any, rank: int) -> dict[str, Any] | None:
    """An ordinary stage's retried task (Spark retries a task whose executor was lost): it starts no worker, since
    the run lost that worker with the first attempt; its result says so. None for a first attempt."""
    if ctx.attemptNumber() == 0:
        return None
    return {"rank": rank, "code": 1, "rows": -1, "log": "", "error": "", "lost": True}


def run_task(spec: TaskSpec, rows: Iterator[Any]) -> Iterator[dict[str, Any]]:
    """``rdd.barrier().mapPartitions`` body (an RDD of pairs on a classic session; ``rdd.mapPartitions`` under
    dynamic allocation): one result dict."""
    ctx = task_context(spec)
    again = None if spec.barrier else retried(ctx, ctx.partitionId())
    if again is not None:
        yield again
        return
    write = None if spec.layout is None else (lambda d: write_partition(rows, spec.layout, d))
    yield task_body(spec, ctx.partitionId(), ctx.resources(), write, ctx.cpus())


def arrow_task(spec: TaskSpec, batches: Iterator[Any]) -> Iterator[Any]:
    """``DataFrame.mapInArrow(..., barrier=True)`` body (``barrier=False`` under dynamic allocation), for classic
    and Connect sessions alike: this task's partition arrives as Arrow record batches; one result row goes back."""
    import pyarrow as pa

    ctx = task_context(spec)
    write = None if spec.layout is None else (
        lambda d: write_split_batches(batches, spec.layout, d, spec.validation))
    again = None if spec.barrier else retried(ctx, ctx.partitionId())
    if again is not None:
        write = None
        result = {key: again[key] for key in ("rank", "code", "rows", "log", "error")}
    else:
        result = task_body(spec, ctx.partitionId(), ctx.resources(), write, ctx.cpus())
    if write is None:
        for _ in batches:  # spark.range's rows: nothing to read, but the input is consumed
            pass
    result["log"] = result["log"][-4000:]
    yield pa.RecordBatch.from_pylist([result], schema=pa.schema([
        ("rank", pa.int64()), ("code", pa.int64()), ("rows", pa.int64()), ("log", pa.string()),
        ("error", pa.string())]))


def single_task(spec: TaskSpec, rank: int, rows: Iterator[Any]) -> Iterator[dict[str, Any]]:
    """An elastic run's worker ``rank``: the one ordinary task of its own job (``rdd.mapPartitions`` body).
    A retry of it (Spark retries a task whose executor was lost) starts no worker: that worker is gone and
    the others went on without it; it returns at once, marked lost."""
    from pyspark import TaskContext

    for _ in rows:  # its one row, the rank
        pass
    ctx = TaskContext.get()
    yield retried(ctx, rank) or task_body(spec, rank, ctx.resources(), cpus=ctx.cpus())


def task_body(spec: TaskSpec, rank: int, resources: Mapping[str, Any],
              write: Any = None, cpus: int = 1) -> dict[str, Any]:
    """One barrier task: write its partition (``write(directory) -> rows``), start or claim a worker,
    wait for it. Never raises: a failed barrier stage would be retried with workers the coordinator
    already counted, so failures are reported to the driver (and returned) instead. ``cpus``: the task's
    (``TaskContext.cpus()``), the worker's thread budget where the driver leaves it to the task."""
    from ..wire.handover import job_line
    from ..wire.secret import hand_over
    from . import warm as spark_warm

    secret = bytes.fromhex(spec.secret_hex)
    reporter = _Reporter(spec, secret)
    if reporter.channel is None:  # the coordinator, on the same host, is out of reach too: no worker
        return {"rank": rank, "code": 1, "rows": -1, "log": reporter.error, "error": reporter.error}
    workdir = tempfile.mkdtemp(prefix=f"nbdist-task{rank}-", dir=local_dir())
    log_path = os.path.join(workdir, "worker.log")
    proc: subprocess.Popen | spark_warm.ClaimedWorker | None = None
    code, tail, rows, error = 1, "", -1, ""
    end: ChildEnd | None = None
    threads = spec.threads or max(1, int(cpus))
    env = worker_env(threads, backend=spec.keras_backend)
    executor = executor_id()
    pool = None  # this executor's warm workers, if it keeps any
    try:
        devices = task_visible_devices(resources)
        if devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        elif spec.warm and executor is not None:  # not with GPUs: the device is chosen before TF starts
            pool = spark_warm.pool_dir(executor)
        job_env = {}
        if write is not None:
            written = write(workdir)
            rows, val_rows = written if isinstance(written, tuple) else (written, 0)
            # The driver sizes every worker's epoch from these counts: no separate count pass, whose
            # partitions could differ from the ones read here (an uncached, recomputed DataFrame).
            reporter.send(TaskRows(rank, rows, val_rows))
            job_env[DATA_ENV] = workdir
        if pool is not None:
            proc = spark_warm.claim(pool, env, job_line(spec.address, rank, job_env), secret)
        if proc is not None:
            log_path = _move(proc.log_path, log_path)
        else:
            with open(log_path, "wb") as out:
                oom_kills = oom_kill_count()
                proc = subprocess.Popen(
                    job_command(spec.address, rank, die_with_parent=True),  # dies with this task's Python process
                    env={**env, **job_env}, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True)
                hand_over(proc, secret)  # on stdin, not in the worker's command line or environment
        reporter.send(TaskStarted(rank, proc.pid, socket.gethostname(), isinstance(proc, spark_warm.ClaimedWorker),
                                  threads))
        if isinstance(proc, subprocess.Popen):  # its own child: reaped with its peak memory
            end = reap(proc.pid, oom_kills, block=True)
            proc.returncode = code = end.code if end is not None else proc.wait()
        else:
            code = proc.wait()
        tail = read_log_tail(log_path, 40)
    except DiskFull as exc:  # named, not a traceback: the user frees space or moves spark.local.dir
        error = tail = str(exc.strerror)
    except BaseException:  # includes the task being interrupted
        tail = (read_log_tail(log_path, 40) + "\n" if proc is not None else "") + traceback.format_exc()
        code = proc.poll() if proc is not None and proc.poll() is not None else 1
    finally:
        if proc is not None and proc.poll() is None:
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        reporter.send(TaskExit(rank, code, tail, time.time(), error, bool(end and end.oom_killed),
                               end.peak_rss if end is not None else None))
        reporter.close()
        shutil.rmtree(workdir, ignore_errors=True)
        if pool is not None:  # the next job's worker imports TensorFlow while the notebook idles
            try:
                spark_warm.start(pool, env, executor)
            except OSError as exc:
                log.warning("could not start a warm worker: %s", exc)
    return {"rank": rank, "code": code, "rows": rows, "log": tail, "error": error}
