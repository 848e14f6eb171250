"""What data is, for every entry point: the one module that decides (pure numpy, no Keras, no Spark).

``model.fit`` under ``%%dist_train``, ``--data X,y``, ``nbdist.train(model, x, y)``, ``%dist_evaluate``
and ``%dist_predict`` all take their in-memory data through ``make_fit_data``: ``x``, ``y`` and the
sample weights may each be an array (numpy, pandas, a nested list, a whole-file ``np.load(...,
mmap_mode="r")``), a list of them or a dict of them (several inputs / outputs), all with the same
number of rows; a ``keras.utils.PyDataset`` goes through ``make_py_dataset_data``; a ``tf.data``
pipeline, a generator or a torch DataLoader is refused in one sentence (``pipeline_message``).
Spark DataFrames and RDDs stay on the executors (spark/data.py). The driver splits the rows
exactly as Keras would (``validation_split`` takes the last rows, before any shuffling;
``class_weight`` becomes per-row sample weights), deals them so that every global batch is split
over the workers (``deal_rows``), and sends each worker its rows as flat arrays plus a JSON
layout that rebuilds the nesting on the worker (``flatten`` / ``unflatten``).
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import NbdistError

# An array, a list of Structs or a dict of Structs (or None: not given).
Struct = Any


@dataclass(frozen=True)
class NpyFile:
    """Where a memory-mapped array's rows lie: a whole .npy file (``np.load(path, mmap_mode="r")``)."""

    path: str
    offset: int  # bytes of header before the first row
    dtype: str
    shape: tuple[int, ...]

    def rows(self, start: int, stop: int) -> dict[str, Any]:
        """What a local worker's job says about its rows ``start:stop`` of this file."""
        return {**self._where(), "start": int(start), "stop": int(stop)}

    def dealt(self, global_batch: int, world: int, rank: int) -> dict[str, Any]:
        """What a local worker's job says about its dealt rows of this file (``dealt_rows``)."""
        return {**self._where(), "deal": [int(self.shape[0]), int(global_batch), int(world), int(rank)]}

    def _where(self) -> dict[str, Any]:
        return {"path": self.path, "offset": self.offset, "dtype": self.dtype, "shape": list(self.shape)}


def file_index(data_file: dict[str, Any]) -> np.ndarray:
    """The rows of the file a job's ``data_file`` names, in the order the worker reads them."""
    if "deal" in data_file:
        return dealt_rows(*(int(v) for v in data_file["deal"]))
    return np.arange(int(data_file["start"]), int(data_file["stop"]), dtype=np.int64)


def npy_file(arr: Any) -> NpyFile | None:
    """The .npy file a memory map reads in whole (as ``np.load(..., mmap_mode=...)`` returns it), else None.

    A slice or other view of such an array is not taken: its rows are not the file's rows.
    """
    if not isinstance(arr, np.memmap) or not getattr(arr, "filename", None) or not isinstance(arr.base, mmap.mmap):
        return None
    if not arr.flags.c_contiguous or arr.ndim < 1 or arr.dtype.hasobject:
        return None
    try:
        with open(arr.filename, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
            offset = f.tell()
    except (OSError, ValueError):
        return None
    if fortran or tuple(shape) != arr.shape or np.dtype(dtype) != arr.dtype or arr.offset != offset:
        return None
    return NpyFile(str(arr.filename), int(offset), np.lib.format.dtype_to_descr(arr.dtype), tuple(arr.shape))


def not_in_memory(value: Any) -> str | None:
    """The kind of input pipeline ``value`` is, if it is one rather than in-memory data."""
    cls = type(value)
    names = {f"{c.__module__}.{c.__name__}" for c in cls.__mro__}
    if any(n.startswith("tensorflow.python.data") for n in names):
        return "a tf.data.Dataset"
    if any("torch.utils.data" in n for n in names):
        return "a torch DataLoader"
    if hasattr(value, "__next__") or (hasattr(value, "__iter__") and not isinstance(value, (list, tuple, dict))
                                      and not hasattr(value, "shape") and not hasattr(value, "to_numpy")):
        return "a generator or iterator"
    return None


def pipeline_message(kind: str, what: str) -> str:
    return (f"{what} is {kind}: nbdist splits in-memory data over the workers and cannot split a stream "
            f"soundly; pass the arrays it reads from (numpy arrays, pandas, or a dict or list of them) "
            f"to model.fit instead, e.g. model.fit(X, y, batch_size=32), or wrap them in a "
            f"keras.utils.PyDataset, whose batches nbdist deals to the workers.")


# The most an input read whole into the notebook (a tf.data pipeline, a sparse matrix made dense) may take:
# a quarter of the memory available, at most this.
MAX_READ_BYTES = 8 * 2**30


def memory_budget() -> int:
    try:
        import psutil

        return min(MAX_READ_BYTES, psutil.virtual_memory().available // 4)
    except Exception:  # no psutil: the fixed bound
        return MAX_READ_BYTES


def is_scipy_sparse(value: Any) -> bool:
    """A scipy.sparse matrix or array (told by its module, so this module needs no scipy)."""
    return type(value).__module__.startswith("scipy.sparse") and hasattr(value, "toarray")


def dense_from_sparse(value: Any, what: str, budget: int | None = None) -> np.ndarray:
    """A scipy sparse matrix (TfidfVectorizer's, OneHotEncoder's) as the dense rows Keras' Dense layers compute
    on alike; refused in one sentence when that would not fit in memory."""
    rows, cols = value.shape
    dtype = np.float32 if value.dtype.kind in "fb" or value.dtype.itemsize > 4 else value.dtype
    size = rows * cols * np.dtype(dtype).itemsize
    limit = memory_budget() if budget is None else budget
    if size > limit:
        raise NbdistError(f"{what} is a scipy sparse matrix of {rows} x {cols}, {size / 2**30:.1f} GiB as dense rows "
                          f"(more than {limit / 2**30:.1f} GiB); reduce its columns (e.g. max_features=...) or "
                          "train from a Spark DataFrame, which streams.")
    return np.asarray(value.toarray(), dtype=dtype)


def as_array(value: Any, what: str) -> np.ndarray:
    """numpy arrays, pandas objects and nested lists as one array, or one sentence."""
    kind = not_in_memory(value)
    if kind is not None:  # every entry point refuses a stream with the same sentence
        raise NbdistError(pipeline_message(kind, what))
    if is_scipy_sparse(value):
        return dense_from_sparse(value, what)
    if hasattr(value, "to_numpy") and callable(value.to_numpy):  # pandas DataFrame / Series
        value = value.to_numpy()
    try:
        return np.asarray(value)
    except Exception as exc:  # ragged lists and the like
        raise NbdistError(f"{what} cannot be turned into an array ({exc}); pass a numpy array.") from None


def as_text(arr: np.ndarray) -> np.ndarray | None:
    """Strings as Keras takes them (a ``StringLookup`` or ``TextVectorization`` input): numpy str or bytes
    arrays as they are, and object arrays (a list of str, a pandas string column) of only str, or only
    bytes, as fixed-width ones, which cross the wire as raw buffers. None for anything else."""
    if arr.dtype.kind in "US":
        return arr
    if arr.dtype != object or arr.size == 0:
        return None
    flat = arr.ravel()
    if all(isinstance(v, str) for v in flat):
        return arr.astype(str)
    if all(isinstance(v, bytes) for v in flat):
        return arr.astype(bytes)
    return None


def has_text(struct: Any) -> bool:
    """Whether any array of ``struct`` (an array, or a dict or list of them) holds numpy str or bytes."""
    return any(getattr(a, "dtype", None) is not None and a.dtype.kind in ("U", "S") for a in flatten(struct)[1])


def tf_structure(struct: Any) -> Any:
    """Lists as tuples: tf.data takes a list for ONE tensor (stacking it) and a tuple for several, so
    a list of inputs (``model.fit([x_a, x_b], y)``) must cross tf.data as a tuple."""
    if isinstance(struct, dict):
        return {k: tf_structure(v) for k, v in struct.items()}
    if isinstance(struct, (list, tuple)):
        return tuple(tf_structure(v) for v in struct)
    return struct


def non_finite(arr: np.ndarray, block_bytes: int = 16 * 2**20) -> int:
    """NaN and infinite values in ``arr``, counted a block of rows at a time. A whole-file memory map
    is read with plain file reads: pages read through the map would stay in the notebook's RSS."""
    if arr.ndim == 0 or len(arr) == 0:
        return 0
    step = max(1, block_bytes // max(1, arr[:1].nbytes))
    source = npy_file(arr)
    if source is None:
        return sum(int(np.size(arr[i:i + step]) - np.count_nonzero(np.isfinite(arr[i:i + step])))
                   for i in range(0, len(arr), step))
    per_row = int(np.prod(arr.shape[1:], dtype=np.int64))
    bad = 0
    with open(source.path, "rb") as f:
        f.seek(source.offset)
        for i in range(0, len(arr), step):
            block = np.fromfile(f, dtype=arr.dtype, count=min(step, len(arr) - i) * per_row)
            bad += int(block.size - np.count_nonzero(np.isfinite(block)))
    return bad


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """Split ``n`` rows into ``shards`` contiguous ranges whose sizes differ by at most one."""
    if shards < 1:
        raise ValueError("shards must be >= 1")
    base, extra = divmod(n, shards)
    bounds, start = [], 0
    for i in range(shards):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def batch_bounds(n: int, batch_size: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous ranges of whole batches of ``batch_size`` rows (the last one short), the batches spread
    as ``shard_bounds`` spreads rows: every worker's batches are batches of one pass over all the rows,
    so what Keras computes per batch is the same sharded or not. Ranges are empty when there are fewer
    batches than shards."""
    return [(min(n, a * batch_size), min(n, b * batch_size))
            for a, b in shard_bounds(batches_per_epoch(n, batch_size), shards)]


def check_workers(n: int, workers: int, what: str = "training data") -> None:
    if workers > n:
        raise NbdistError(
            f"{workers} workers but only {n} examples in the {what}; use --workers {max(1, n)} or fewer."
        )


def batches_per_epoch(samples: int, batch_size: int) -> int:
    return -(-samples // batch_size)


def is_py_dataset(value: Any) -> bool:
    """A ``keras.utils.PyDataset`` (told by its class, so this module needs no Keras)."""
    return any(c.__name__ == "PyDataset" and c.__module__.startswith("keras") for c in type(value).__mro__)


def to_struct(value: Any, what: str) -> Struct:
    """numpy/pandas leaves, lists and dicts of them; one sentence for anything else."""
    if value is None:
        return None
    if isinstance(value, dict):
        if not value:
            raise NbdistError(f"{what} is an empty dict; give one array per model input or output.")
        return {str(k): to_struct(v, f"{what}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        if value and all(np.isscalar(v) or _row(v) for v in value):  # a list of numbers or of rows: one array
            return _leaf(value, what)
        if not value:
            raise NbdistError(f"{what} is empty; pass at least one example per worker.")
        return [to_struct(v, f"{what}[{i}]") for i, v in enumerate(value)]
    kind = not_in_memory(value)
    if kind is not None:
        raise NbdistError(pipeline_message(kind, what))
    return _leaf(value, what)


def _row(value: Any) -> bool:
    """A plain list (or tuple) of numbers: one row of a table given as nested lists."""
    return isinstance(value, (list, tuple)) and bool(value) and all(np.isscalar(v) for v in value)


def _leaf(value: Any, what: str) -> np.ndarray:
    arr = as_array(value, what)
    text = as_text(arr)
    if text is not None:  # strings for the model's own text layers
        if text.ndim == 0:
            raise NbdistError(f"{what} is a single value, not a dataset; pass one row per example.")
        return text
    if arr.dtype == object:
        raise NbdistError(f"{what} holds Python objects, not numbers in one array; pass a numpy array per "
                          "input (several inputs as a dict or list of arrays), e.g. .astype('float32').")
    if arr.dtype.kind == "b":
        arr = arr.astype("float32")
    if arr.dtype.kind not in "iuf":
        raise NbdistError(f"{what} has dtype {arr.dtype}, not numbers; convert it first, e.g. .astype('float32').")
    if arr.ndim == 0:
        raise NbdistError(f"{what} is a single value, not a dataset; pass one row per example.")
    if npy_file(value) is not None:  # stays on disk: local workers read (and cast) their rows themselves
        return value
    if arr.dtype == np.float64:  # Keras trains in float32; halve what crosses the wire
        arr = arr.astype(np.float32)
    return arr


def leaves(struct: Struct) -> list[np.ndarray]:
    if struct is None:
        return []
    if isinstance(struct, dict):
        return [a for v in struct.values() for a in leaves(v)]
    if isinstance(struct, list):
        return [a for v in struct for a in leaves(v)]
    return [struct]


def fill_leaves(struct: Struct, values: dict[int, Any]) -> Struct:
    """``struct`` (a dict or list) with its leaves at places ``values`` (their order in ``leaves``; a leaf
    left out as None keeps its place) replaced by those values."""
    place = 0

    def put(node: Any) -> Any:
        nonlocal place
        if isinstance(node, dict):
            return {k: put(v) for k, v in node.items()}
        if isinstance(node, list):
            return [put(v) for v in node]
        place += 1
        return values.get(place - 1, node)

    return put(struct)


def map_struct(fn: Any, struct: Struct) -> Struct:
    if struct is None:
        return None
    if isinstance(struct, dict):
        return {k: map_struct(fn, v) for k, v in struct.items()}
    if isinstance(struct, list):
        return [map_struct(fn, v) for v in struct]
    return fn(struct)


def flatten(struct: Struct) -> tuple[Any, list[np.ndarray]]:
    """A JSON layout and the arrays in order; ``unflatten`` reverses it."""
    if struct is None:
        return None, []
    if isinstance(struct, dict):
        parts = [flatten(v) for v in struct.values()]
        return {"dict": list(struct), "items": [p[0] for p in parts]}, [a for p in parts for a in p[1]]
    if isinstance(struct, list):
        parts = [flatten(v) for v in struct]
        return {"list": [p[0] for p in parts]}, [a for p in parts for a in p[1]]
    return "array", [struct]


def unflatten(layout: Any, arrays: Iterator[np.ndarray]) -> Struct:
    if layout is None:
        return None
    if layout == "array":
        return next(arrays)
    if "dict" in layout:
        return {k: unflatten(sub, arrays) for k, sub in zip(layout["dict"], layout["items"])}
    return [unflatten(sub, arrays) for sub in layout["list"]]


@dataclass(frozen=True)
class FitData:
    """x, y and sample weights of one split (training or validation), with equal row counts."""

    x: Struct
    y: Struct = None
    sample_weight: Struct = None

    def __len__(self) -> int:
        return len(leaves(self.x)[0])

    @property
    def x_file(self) -> NpyFile | None:
        """The .npy file ``x`` is the whole-file memory map of (``npy_file``), else None."""
        return npy_file(self.x)

    @property
    def x_leaves(self) -> dict[int, NpyFile]:
        """Inputs of a dict or list ``x`` that are whole-file memory maps, by their place in ``leaves(x)``."""
        if not isinstance(self.x, (dict, list)):
            return {}
        return {i: f for i, a in enumerate(leaves(self.x)) if (f := npy_file(a)) is not None}

    def without_x_leaves(self, drop: Any) -> FitData:
        """This data with the inputs at places ``drop`` left out (None): the workers read them from their files."""
        return FitData(fill_leaves(self.x, {int(i): None for i in drop}), self.y, self.sample_weight)

    def take(self, index: np.ndarray | slice) -> FitData:
        pick = lambda a: a[index]
        return FitData(map_struct(pick, self.x), map_struct(pick, self.y), map_struct(pick, self.sample_weight))

    def slice(self, start: int, stop: int) -> FitData:
        return self.take(slice(start, stop))

    def flatten(self) -> tuple[dict[str, Any], list[np.ndarray]]:
        layout, arrays = {}, []
        for name in ("x", "y", "sample_weight"):
            sub, arrs = flatten(getattr(self, name))
            layout[name] = sub
            arrays += arrs
        return layout, arrays

    @classmethod
    def unflatten(cls, layout: dict[str, Any], arrays: Iterator[np.ndarray]) -> FitData:
        return cls(*(unflatten(layout[name], arrays) for name in ("x", "y", "sample_weight")))


def make_fit_data(x: Any, y: Any = None, sample_weight: Any = None, what: str = "training data") -> FitData:
    data = FitData(to_struct(x, f"{what} x"), to_struct(y, f"{what} y"),
                   to_struct(sample_weight, f"{what} sample_weight"))
    if data.x is None:
        raise NbdistError(f"{what}: x is missing; pass the features, e.g. model.fit(X, y).")
    counts = {len(a) for a in leaves(data.x) + leaves(data.y) + leaves(data.sample_weight)}
    if len(counts) > 1:
        parts = []
        for name in ("x", "y", "sample_weight"):
            rows = sorted({len(a) for a in leaves(getattr(data, name))}, reverse=True)
            if rows:
                parts.append(f"{name} has {' and '.join(map(str, rows))} rows")
        raise NbdistError(f"{what}: {' but '.join(parts)}; every input, label and weight array needs one row "
                          "per example (pass X and y of the same length).")
    if len(data) == 0:
        raise NbdistError(f"{what} is empty; pass at least one example per worker.")
    for name, part in (("features", data.x), ("labels", data.y), ("sample weights", data.sample_weight)):
        for a in leaves(part):
            bad = non_finite(a) if a.dtype.kind == "f" else 0
            if bad:
                raise NbdistError(f"{what}: the {name} hold {bad} NaN or infinite values; clean or impute them "
                                  "before training.")
    return data


def class_weight_to_sample_weight(y: Struct, class_weight: dict[Any, float]) -> np.ndarray:
    """Keras's rule: the weight of each row's class (argmax of one-hot rows), 1.0 for unlisted classes."""
    if not isinstance(class_weight, dict):
        raise NbdistError(f"class_weight must be a dict mapping class index to weight, got "
                          f"{type(class_weight).__name__}; e.g. class_weight={{0: 1.0, 1: 5.0}}.")
    if y is None or isinstance(y, (dict, list)):
        raise NbdistError("class_weight needs one label array (a single-output model); for several outputs "
                          "pass sample_weight per output instead.")
    labels = np.asarray(y)
    if labels.ndim > 1:
        labels = labels.argmax(axis=-1) if labels.shape[-1] != 1 else labels.reshape(len(labels))
    labels = np.round(labels).astype(np.int64)
    table = {int(k): float(v) for k, v in class_weight.items()}
    return np.array([table.get(int(c), 1.0) for c in labels], dtype=np.float32)


def split_validation(data: FitData, fraction: float) -> tuple[FitData, FitData]:
    """Keras's ``validation_split``: the last ``fraction`` of the rows, taken before any shuffling."""
    if not isinstance(fraction, (int, float)) or not 0.0 < float(fraction) < 1.0:
        raise NbdistError(f"validation_split must be a fraction between 0 and 1, got {fraction!r}; e.g. 0.1.")
    n = len(data)
    split_at = int(math.floor(n * (1.0 - float(fraction))))
    if split_at in (0, n):
        raise NbdistError(f"validation_split={fraction} of {n} rows leaves no training or no validation rows; "
                          "use a fraction that leaves both.")
    return data.slice(0, split_at), data.slice(split_at, n)


def rank_batch_sizes(global_batch: int, world: int) -> list[int]:
    """Each worker's share of a global batch: sizes differing by at most one, larger first."""
    if global_batch < world:
        raise NbdistError(f"batch_size {global_batch} cannot be split over {world} workers; use a batch_size of "
                          f"at least {world} (it is the global batch, split over the workers).")
    base, extra = divmod(global_batch, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def deal_rows(n: int, global_batch: int, world: int) -> list[np.ndarray]:
    """Row indices per worker such that global batch i (rows i*B .. i*B+B-1) is split over the workers
    in order, the last short batch too: worker r's batch i is its part of global batch i, so a step
    of all workers together sees the rows of one local ``fit`` step."""
    return [dealt_rows(n, global_batch, world, r) for r in range(world)]


def dealt_rows(n: int, global_batch: int, world: int, rank: int) -> np.ndarray:
    """Worker ``rank``'s rows of ``deal_rows`` (a local worker computes its own from a memory-mapped file's job)."""
    sizes = rank_batch_sizes(global_batch, world)
    first, size = sum(sizes[:rank]), sizes[rank]
    full, rest = divmod(n, global_batch)
    rows = (np.arange(full, dtype=np.int64)[:, None] * global_batch + first + np.arange(size, dtype=np.int64)).ravel()
    if rest:
        rows = np.concatenate([rows, np.array_split(np.arange(full * global_batch, n, dtype=np.int64), world)[rank]])
    return rows


# -- a keras.utils.PyDataset: its batches dealt to the workers ----------------------------
@dataclass(frozen=True)
class PyDatasetData:
    """A notebook's PyDataset as it travels: cloudpickled by value, with what the driver learnt from
    its first batch. Each worker reads only its share of the batch indices (``share_indices``)."""

    payload: bytes  # cloudpickle of the dataset
    batches: int  # len(dataset): batches per epoch
    first_rows: int  # rows of batch 0: the driver's estimate of every batch's rows (progress only)
    class_weight: dict[int, float] | None = None
    # Batch 0's first row, (x,), (x, y) or (x, y, sample_weight): what the driver checks the model's
    # inputs against and builds its copy's metric variables from, without reading the dataset again.
    first_row: tuple[Any, ...] = ()

    def __len__(self) -> int:
        return self.batches


def share_count(batches: int, rank: int, world: int) -> int:
    """Batches of an epoch worker ``rank`` reads: indices rank, rank + world, ... (strided)."""
    return len(range(rank, batches, world))


def epoch_order(batches: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The batch indices of one epoch, the same on every worker: shuffled by (seed, epoch) as Keras
    shuffles a PyDataset's batch order when ``shuffle=True``, else in order."""
    order = np.arange(batches, dtype=np.int64)
    if shuffle:
        np.random.default_rng([int(seed), int(epoch)]).shuffle(order)
    return order


def share_indices(order: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Worker ``rank``'s batches of an epoch, strided: step j of all workers reads
    ``order[j*world : (j+1)*world]``, so one step consumes ``world`` consecutive batches of the epoch."""
    return order[rank::world]


def strided_batches(shares: list[list[Any]]) -> list[Any]:
    """The batches of one unshuffled pass in the dataset's order, from each worker's share of them in
    its order (``share_indices``): batch i is worker ``i % world``'s batch ``i // world``."""
    world = len(shares)
    return [shares[i % world][i // world] for i in range(sum(len(s) for s in shares))]


def standardize_batch(batch: Any, class_weight: dict[int, float] | None = None) -> tuple[Any, ...]:
    """A PyDataset item as Keras reads it: ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` as a tuple
    (a lone array or dict is ``x``); ``class_weight`` adds per-row weights from ``y``. Leaves as numpy."""
    if isinstance(batch, dict) or hasattr(batch, "shape"):
        batch = (batch,)
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple) or len(batch) not in (1, 2, 3):
        raise NbdistError(f"the PyDataset's __getitem__ returned {type(batch).__name__}; return (x, y), "
                          "(x, y, sample_weight) or x, as Keras expects.")
    parts = tuple(map_struct(np.asarray, to_struct(part, "a PyDataset batch")) for part in batch)
    if class_weight is not None:
        if len(parts) != 2:
            raise NbdistError("class_weight with a PyDataset needs batches of (x, y), without sample weights "
                              "(as in Keras).")
        parts = parts + (class_weight_to_sample_weight(parts[1], class_weight),)
    return parts


def batch_rows(batch: tuple[Any, ...]) -> int:
    return len(leaves(batch[0])[0])


def make_py_dataset_data(dataset: Any, what: str, class_weight: dict[Any, float] | None = None) -> PyDatasetData:
    """Check a PyDataset here (its length, its first batch, that it can travel): one sentence otherwise."""
    try:
        batches = dataset.num_batches
    except Exception as exc:
        raise NbdistError(f"{what} is a PyDataset without a length ({type(exc).__name__}); define __len__ "
                          "(or num_batches) so its batches can be split over the workers.") from None
    if batches is None:
        raise NbdistError(f"{what} is an infinite PyDataset (num_batches is None); nbdist splits an epoch's "
                          "batches over the workers: give it a length.")
    if int(batches) < 1:
        raise NbdistError(f"{what} is a PyDataset of length 0; it needs at least one batch.")
    try:
        first = dataset[0]
    except Exception as exc:
        raise NbdistError(f"{what}: reading batch 0 of the PyDataset failed ({type(exc).__name__}: {exc}); "
                          "fix its __getitem__ so that it runs locally first.") from None
    table = None
    if class_weight is not None:
        if not isinstance(class_weight, dict):
            class_weight_to_sample_weight(None, class_weight)  # its sentence
        table = {int(k): float(v) for k, v in class_weight.items()}
    parts = standardize_batch(first, table)
    rows = batch_rows(parts)
    import cloudpickle

    try:
        payload = cloudpickle.dumps(dataset)
    except Exception as exc:
        raise NbdistError(f"{what}: the PyDataset cannot be sent to the workers ({type(exc).__name__}: {exc}); "
                          "keep arrays, file paths and plain values in it, not open files or connections.") from None
    first_row = tuple(map_struct(lambda a: a[:1], part) for part in parts)
    return PyDatasetData(payload, int(batches), rows, table, first_row)


def all_zero(a: np.ndarray, min_bytes: int = 0) -> bool:
    """Whether a numeric array (of ``min_bytes`` or more) holds only zeros, as a fresh optimizer's slots do:
    a sparse sample first, so an array of data is rarely read whole for it."""
    if a.nbytes < max(min_bytes, 1) or a.dtype.kind not in "biuf":
        return False
    flat = a.reshape(-1)
    return not flat[::max(1, flat.size // 256)].any() and not flat.any()
