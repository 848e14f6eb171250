"""Nested data (an array, a list or a dict of them): conversion to arrays, flattening for the wire and back."""
from __future__ import annotations

import collections
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import NbdistError
from ..machine.keras_backend import notebook_backend
from .files import memory_budget, not_in_memory, npy_file, pipeline_message
from .ragged import RaggedRows, concat, is_ragged, ragged_rows

# An array, a list of Structs or a dict of Structs (or None: not given).
Struct = Any


def sparse_kind(value: Any) -> str | None:
    """What sparse input ``value`` is (told by its class, so this module imports none of them), else None."""
    cls = type(value)
    if cls.__module__.startswith("scipy.sparse") and hasattr(value, "toarray"):
        return "scipy sparse matrix"
    if cls.__name__ == "SparseTensor" and cls.__module__.startswith("tensorflow"):
        return "tf.SparseTensor"
    if cls.__name__ == "BCOO" and cls.__module__.startswith("jax"):
        return "JAX BCOO array"
    return None


def dense_from_sparse(value: Any, what: str, budget: int | None = None) -> np.ndarray:
    """A sparse input (a scipy matrix, TfidfVectorizer's or OneHotEncoder's; a tf.SparseTensor; a JAX BCOO array)
    as the dense rows Keras' Dense layers compute on alike; refused in one sentence when that would not fit in
    memory."""
    kind = sparse_kind(value)
    given = np.dtype(value.dtype.as_numpy_dtype) if kind == "tf.SparseTensor" else np.dtype(value.dtype)
    dtype = np.float32 if given.kind in "fb" or given.itemsize > 4 else given
    shape = tuple(int(d) for d in value.shape)
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    limit = memory_budget() if budget is None else budget
    if size > limit:
        raise NbdistError(f"{what} is a {kind} of {' x '.join(map(str, shape))}, {size / 2**30:.1f} GiB as dense "
                          f"rows (more than {limit / 2**30:.1f} GiB); reduce its columns (e.g. max_features=...) or "
                          "train from a Spark DataFrame, which streams.")
    if kind == "tf.SparseTensor":
        import tensorflow as tf

        return np.asarray(tf.sparse.to_dense(value).numpy(), dtype=dtype)
    return np.asarray(value.toarray() if kind == "scipy sparse matrix" else value.todense(), dtype=dtype)


def as_array(value: Any, what: str) -> np.ndarray:
    """numpy arrays, pandas objects and nested lists as one array, or one sentence."""
    kind = not_in_memory(value)
    if kind is not None:  # every entry point refuses a stream with the same sentence
        raise NbdistError(pipeline_message(kind, what))
    if sparse_kind(value) is not None:
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
    return any(isinstance(getattr(a, "dtype", None), np.dtype) and a.dtype.kind in "US" for a in flatten(struct)[1])


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
    is read with plain file reads: pages read through the map would stay in the notebook's RSS. Ragged
    rows: their values."""
    if isinstance(arr, RaggedRows):
        arr = arr.values
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
    if isinstance(value, RaggedRows):  # a ragged input already read (a generator's batches, joined)
        return value
    kind = not_in_memory(value)
    if kind is not None:
        raise NbdistError(pipeline_message(kind, what))
    if is_ragged(value):
        return _ragged_leaf(value, what)
    return _leaf(value, what)


def _ragged_leaf(value: Any, what: str) -> RaggedRows:
    """A tf.RaggedTensor as its numpy components (data/ragged.py), on Keras' TensorFlow backend, where Keras
    takes it as it is (on JAX and torch Keras pads each batch of it, which nbdist leaves to the user)."""
    backend = notebook_backend()
    if backend != "tensorflow":
        raise NbdistError(f"{what} is a tf.RaggedTensor, which nbdist takes on Keras' TensorFlow backend only (on "
                          f"{backend}, Keras pads each batch of it to its longest row); pad it yourself "
                          "(x.to_tensor()) or set KERAS_BACKEND=tensorflow.")
    rows = ragged_rows(value)
    text = as_text(rows.values)
    if text is not None:  # tf.string values: fixed-width bytes, as for arrays of text
        return RaggedRows(text, rows.splits)
    if rows.dtype.kind not in "biuf":
        raise NbdistError(f"{what} is a tf.RaggedTensor of {rows.dtype}, not numbers or text; cast it first, "
                          "e.g. tf.cast(x, 'float32').")
    return rows


def _row(value: Any) -> bool:
    """A plain list (or tuple) of numbers: one row of a table given as nested lists."""
    return isinstance(value, (list, tuple)) and bool(value) and all(np.isscalar(v) for v in value)


def _narrow_float(dtype: np.dtype) -> bool:
    """ml_dtypes' floats (bfloat16, float8_*), which numpy sees as raw bytes: float32 holds each exactly, and Keras
    casts a floating input to the layer's compute dtype either way."""
    return dtype.kind == "V" and (dtype.name == "bfloat16" or dtype.name.startswith("float"))


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
    if arr.dtype.kind == "b" or _narrow_float(arr.dtype):
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
    if isinstance(struct, RaggedRows):  # its values and row splits, rebuilt by unflatten
        return {"ragged": len(struct.splits)}, struct.components()
    return "array", [struct]


def unflatten(layout: Any, arrays: Iterator[np.ndarray]) -> Struct:
    if layout is None:
        return None
    if layout == "array":
        return next(arrays)
    if "ragged" in layout:
        return RaggedRows.from_components([next(arrays) for _ in range(1 + int(layout["ragged"]))])
    if "dict" in layout:
        return {k: unflatten(sub, arrays) for k, sub in zip(layout["dict"], layout["items"])}
    return [unflatten(sub, arrays) for sub in layout["list"]]


def flatten_outputs(out: Any) -> tuple[Any, list[np.ndarray]]:
    """A model's outputs (``model.predict``'s answer) as ``flatten`` lays them out, with each tuple marked
    (a namedtuple with its class's module, name and fields) so ``unflatten_outputs`` gives Keras' structure."""
    if isinstance(out, dict):
        parts = [flatten_outputs(v) for v in out.values()]
        return {"dict": [str(k) for k in out], "items": [p[0] for p in parts]}, [a for p in parts for a in p[1]]
    if isinstance(out, (list, tuple)):
        parts = [flatten_outputs(v) for v in out]
        layout: dict[str, Any] = {"list": [p[0] for p in parts]}
        if isinstance(out, tuple):
            cls = type(out)
            layout["tuple"] = [cls.__module__, cls.__qualname__, list(out._fields)] if hasattr(out, "_fields") else []
        return layout, [a for p in parts for a in p[1]]
    if is_ragged(out):  # a model with ragged outputs: predict gives a tf.RaggedTensor
        return flatten(ragged_rows(out))
    return "array", [np.asarray(out)]


def concat_flat(layout: Any, parts: list[list[np.ndarray]]) -> list[np.ndarray]:
    """Several flattenings with one ``layout`` (shards' rows, in order) as the flattening of all their rows:
    each array's rows joined, ragged rows' splits shifted (``ragged.concat``)."""
    out: list[np.ndarray] = []
    at = 0
    for leaf in _leaf_layouts(layout):
        width = 1 if leaf == "array" else 1 + int(leaf["ragged"])
        if leaf == "array":
            out.append(np.concatenate([p[at] for p in parts], axis=0))
        else:
            out += concat([RaggedRows.from_components(p[at:at + width]) for p in parts]).components()
        at += width
    return out


def _leaf_layouts(layout: Any) -> Iterator[Any]:
    if layout is None:
        return
    if layout == "array" or "ragged" in layout:
        yield layout
        return
    for sub in layout["items"] if "dict" in layout else layout["list"]:
        yield from _leaf_layouts(sub)


def unflatten_outputs(layout: Any, arrays: Iterator[np.ndarray]) -> Any:
    """``flatten_outputs`` reversed: lists, tuples and namedtuples (the notebook's own class where it can
    be found by module and name, else one with the same fields) as the model returned them."""
    if layout is None or layout == "array" or "ragged" in layout:
        return unflatten(layout, arrays)
    if "dict" in layout:
        return {k: unflatten_outputs(sub, arrays) for k, sub in zip(layout["dict"], layout["items"])}
    items = [unflatten_outputs(sub, arrays) for sub in layout["list"]]
    if "tuple" not in layout:
        return items
    if not layout["tuple"]:
        return tuple(items)
    module, qualname, fields = layout["tuple"]
    cls: Any = sys.modules.get(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, tuple) and list(getattr(cls, "_fields", ())) == fields):
        cls = collections.namedtuple(qualname.rsplit(".", 1)[-1], fields)
    return cls(*items)


def all_zero(a: np.ndarray, min_bytes: int = 0) -> bool:
    """Whether a numeric array (of ``min_bytes`` or more) holds only zeros, as a fresh optimizer's slots do:
    a sparse sample first, so an array of data is rarely read whole for it."""
    if a.nbytes < max(min_bytes, 1) or a.dtype.kind not in "biuf":
        return False
    flat = a.reshape(-1)
    return not flat[::max(1, flat.size // 256)].any() and not flat.any()
