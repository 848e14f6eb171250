"""What ``fit``'s data becomes at the door: ``FitData`` (arrays, validation split, class weights)
and ``PyDatasetData``.

``model.fit`` under ``%%dist_train``, ``--data X,y``, ``nbdist.train``, ``%dist_evaluate`` and ``%dist_predict``
all take their in-memory data through ``make_fit_data``: ``x``, ``y`` and the sample weights may each be an
array (numpy, pandas, a nested list, a whole-file ``np.load(..., mmap_mode="r")``, a ``tf.RaggedTensor`` as
its numpy components), a list or a dict of them, all with the same number of rows; a PyDataset goes through
``make_py_dataset_data``. Keras' splits are kept: ``validation_split`` takes the last rows, before any
shuffling (``split_validation``); ``class_weight`` becomes per-row sample weights.
"""
from __future__ import annotations

import inspect
import io
import logging
import math
import operator
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import NbdistError
from .files import NpyFile, npy_file
from .ragged import RaggedRows
from .structures import Struct, fill_leaves, flatten, leaves, map_struct, non_finite, to_struct, unflatten

log = logging.getLogger(__name__)


def is_py_dataset(value: Any) -> bool:
    """A ``keras.utils.PyDataset`` (told by its class, so this module needs no Keras)."""
    return any(c.__name__ == "PyDataset" and c.__module__.startswith("keras") for c in type(value).__mro__)


@dataclass(frozen=True)
class FitData:
    """x, y and sample weights of one split (training or validation), with equal row counts."""

    x: Struct
    y: Struct = None
    sample_weight: Struct = None

    def __len__(self) -> int:
        """The rows: x's, or y's where every input is None (Keras counts the arrays it is given)."""
        return next((len(found[0]) for part in (self.x, self.y, self.sample_weight) if (found := leaves(part))), 0)

    @property
    def x_file(self) -> NpyFile | None:
        """The .npy file ``x`` is the whole-file memory map of (``npy_file``), else None. None too where the
        labels are ragged: a worker streams a file's rows with array labels only, so these cross the wire."""
        if any(isinstance(a, RaggedRows) for a in leaves(self.y) + leaves(self.sample_weight)):
            return None
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
    # Keras trains on NaN and infinite values as they are (the loss then may become NaN, which TerminateOnNaN
    # acts on): so does nbdist, saying so in one line.
    found = []
    for name, part in (("features", data.x), ("labels", data.y), ("sample weights", data.sample_weight)):
        bad = sum(non_finite(a) for a in leaves(part) if a.dtype.kind == "f")
        if bad:
            found.append(f"the {name} {bad}")
    if found:
        log.warning("%s holds NaN or infinite values (%s); Keras trains on them as they are, so the loss may become "
                    "NaN (keras.callbacks.TerminateOnNaN stops training there).", what, ", ".join(found))
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


def standardize_batch(batch: Any, class_weight: dict[int, float] | None = None,
                      source: str = "a PyDataset", ragged: bool = False) -> tuple[Any, ...]:
    """A PyDataset item (or another ``source``'s batch) as Keras reads it: ``(x,)``, ``(x, y)`` or ``(x, y,
    sample_weight)`` as a tuple (a lone array or dict is ``x``); ``class_weight`` adds per-row weights from ``y``.
    Leaves as numpy; ``ragged``: a tf.RaggedTensor leaf kept as its rows (batches read once and joined)."""
    if isinstance(batch, dict) or hasattr(batch, "shape"):
        batch = (batch,)
    if isinstance(batch, list):
        batch = tuple(batch)
    if not isinstance(batch, tuple) or len(batch) not in (1, 2, 3):
        raise NbdistError(f"{source}'s batch is {type(batch).__name__}; give (x, y), (x, y, sample_weight) or x, "
                          "as Keras expects.")
    structs = tuple(to_struct(part, f"{source}'s batch") for part in batch)
    if not ragged and any(isinstance(a, RaggedRows) for part in structs for a in leaves(part)):
        raise NbdistError(f"{source}'s batch holds a tf.RaggedTensor, and nbdist reads its batches as arrays; "
                          "give padded batches (x.to_tensor()), or pass the tf.RaggedTensor itself to fit, which "
                          "nbdist splits by rows.")
    parts = tuple(map_struct(lambda a: a if isinstance(a, RaggedRows) else np.asarray(a), part) for part in structs)
    if class_weight is not None:
        if len(parts) != 2:
            raise NbdistError("class_weight with a PyDataset needs batches of (x, y), without sample weights "
                              "(as in Keras).")
        parts = parts + (class_weight_to_sample_weight(parts[1], class_weight),)
    return parts


def batch_rows(batch: tuple[Any, ...]) -> int:
    return int(leaves(batch[0])[0].shape[0])  # an array's or a tf.RaggedTensor's rows


_LOCKS = {type(threading.Lock()): threading.Lock, type(threading.RLock()): threading.RLock}


def dump_dataset(dataset: Any) -> bytes:
    """A PyDataset cloudpickled (its notebook classes by value), with what belongs to one process made anew on
    arrival: a lock, and a generator the dataset made by calling one of its methods and never started (Keras'
    image iterators, ``ImageDataGenerator().flow(...)``, keep both)."""
    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            if type(obj) in _LOCKS:
                return _LOCKS[type(obj)], ()
            if isinstance(obj, types.GeneratorType):
                remade = _method_call(obj)
                if remade is not None:
                    return remade
            return super().reducer_override(obj)

    buf = io.BytesIO()
    Pickler(buf, protocol=5).dump(dataset)
    return buf.getvalue()


def _method_call(gen: types.GeneratorType) -> tuple[Any, tuple[Any, ...]] | None:
    """``(methodcaller(name, *args), (owner,))`` for an unstarted generator made by ``owner.name(*args)``, where
    ``name`` is a method of ``owner``'s class taking positional arguments only; None otherwise."""
    if inspect.getgeneratorstate(gen) != inspect.GEN_CREATED:
        return None
    code, values = gen.gi_code, gen.gi_frame.f_locals
    names = code.co_varnames[:code.co_argcount]
    if not names or names[0] != "self" or code.co_kwonlyargcount or code.co_flags & (
            inspect.CO_VARARGS | inspect.CO_VARKEYWORDS):
        return None
    owner = values.get("self")
    if getattr(getattr(type(owner), gen.__name__, None), "__code__", None) is not code:
        return None
    return operator.methodcaller(gen.__name__, *(values[n] for n in names[1:])), (owner,)


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
    try:
        payload = dump_dataset(dataset)
    except Exception as exc:
        raise NbdistError(f"{what}: the PyDataset cannot be sent to the workers ({type(exc).__name__}: {exc}); "
                          "keep arrays, file paths and plain values in it, not open files or connections.") from None
    first_row = tuple(map_struct(lambda a: a[:1], part) for part in parts)
    return PyDatasetData(payload, int(batches), rows, table, first_row)
