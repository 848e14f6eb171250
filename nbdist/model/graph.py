"""A Keras model as the objects it is: pickled by its attributes, not rebuilt from its config.

Why: a rebuild from configs (Keras' ``.keras`` zip too) loses what no config records: a model's own
``compile(d_optimizer, g_optimizer)`` arguments, an AdamW's ``exclude_from_weight_decay``, attributes set
after construction. So ``dump_graph`` cloudpickles the model (notebook classes and functions by value) with
each Keras object's ``__dict__`` as its state; only what is bound to this process is handled apart
(``_GraphPickler.reducer_override`` lists each case). Variables in ``values_apart`` (weights, optimizer
state) travel without their values, which come as raw arrays so checkpoints and restarts can replace them.
Invariant: ``load_graph`` in another process gives a model that trains as the original; a layer holding a
TensorFlow resource without an assets protocol is refused by ``check_resources`` before any worker starts.
"""
from __future__ import annotations

import collections.abc as cabc
import contextlib
import copyreg
import io
import os
import sys
import tempfile
import weakref
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from .tensors import empty_tensor, tensor_as_array, tensor_from_array, tensor_layout, without_torch_params

# Compiled step functions: bound to this process's graphs; Keras makes them again when None.
_DROPPED = frozenset({"train_function", "test_function", "predict_function"})
# TensorFlow's checkpoint bookkeeping on its trackable objects (a Keras object on that backend is one), made again
# on demand. Any other attribute named ``_self_...`` is the object's own (keras_hub's ``_self_attention_layer``).
_TF_BOOKKEEPING = frozenset({
    "_self_setattr_tracking", "_self_unconditional_checkpoint_dependencies", "_self_unconditional_dependency_names",
    "_self_unconditional_deferred_dependencies", "_self_update_uid", "_self_name_based_restores",
    "_self_saveable_object_factories"})
# A layer's losses added by its last call (an activity regularizer's): Keras clears them at the next call.
_CALL_LOSSES = frozenset({"_losses", "_loss_ids"})


def _keras_classes() -> tuple[type, type, Any, type]:
    import keras
    from keras.src.backend.common.variables import Variable
    from keras.src.saving.keras_saveable import KerasSaveable
    from keras.src.utils import tracking

    return Variable, KerasSaveable, tracking, keras.optimizers.Optimizer


# -- what the model holds ----------------------------------------------------------
def optimizers_of(model: Any) -> list[Any]:
    """Every optimizer the model holds, in a fixed order: the compiled one first, then those
    reachable through its objects' attributes (a GAN's two), each once."""
    _, saveable, _, optimizer = _keras_classes()
    found: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if depth > 8 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, optimizer):
            found.append(obj)
            inner = getattr(obj, "inner_optimizer", None)  # a LossScaleOptimizer's: its state is its own
            if inner is not None:
                seen.add(id(inner))
            return
        if isinstance(obj, saveable):
            for key, value in vars(obj).items():
                if key not in _TF_BOOKKEEPING and key not in _DROPPED:
                    visit(value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value, depth + 1)
        elif isinstance(obj, dict):
            for value in obj.values():
                visit(value, depth + 1)

    compiled = getattr(model, "optimizer", None)
    if compiled is not None:
        visit(compiled, 0)
    visit(model, 0)
    return found


def optimizer_state_variables(model: Any) -> list[Any]:
    """Every optimizer's whole state (slots, step counters, loss scale, EMA and accumulators), in a
    fixed order; not learning rates, which the run sets itself (schedules, scaling, callbacks)."""
    out: list[Any] = []
    seen: set[int] = set()
    for opt in optimizers_of(model):
        for v in opt.variables:
            if id(v) in seen or variable_path(v).endswith("learning_rate"):
                continue
            seen.add(id(v))
            out.append(v)
    return out


def variable_path(v: Any) -> str:
    return str(getattr(v, "path", None) or v.name)


# -- pickling ------------------------------------------------------------------------
def dump_graph(model: Any, values_apart: cabc.Iterable[Any] = ()) -> bytes:
    """The model object pickled; variables in ``values_apart`` travel without their values."""
    buf = io.BytesIO()
    pickler = _GraphPickler(buf, protocol=5)
    pickler.apart = {id(v) for v in values_apart}
    pickler.apart_tensors = {id(t) for t in map(_torch_parameter, values_apart) if t is not None}
    pickler.var_keys = _var_keys(model)
    _deep(lambda: pickler.dump(model), levels=_PICKLE_LEVELS_PER_LAYER * len(model._flatten_layers()))
    return buf.getvalue()


# Pickling recurses through the layer graph (a layer, its nodes, the layers before it, ...): about 20
# levels per layer. Python's default limit of 1000 stops at ~50 layers deep; MobileNetV2 needs 2,000,
# DenseNet121 8,000.
_PICKLE_LEVELS_PER_LAYER = 40
_DEEP_STACK_BYTES = 512 * 2**20  # address space reserved for the pickling thread; only what it touches is used


def _deep(work: cabc.Callable[[], Any], levels: int) -> Any:
    """``work()`` with room for ``levels`` of recursion: in a thread whose C stack is large enough for them
    (the interpreter's own can be 8 MB), with the recursion limit raised while it runs."""
    import threading

    if levels + 1000 <= sys.getrecursionlimit():
        return work()
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(levels + 1000)  # per interpreter: restored when the thread ends
    try:
        old_stack = threading.stack_size(_DEEP_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="nbdist-deep-pickle", daemon=True)
            thread.start()
        finally:
            threading.stack_size(old_stack)
        thread.join()
    finally:
        sys.setrecursionlimit(old_limit)
    if "error" in result:
        raise result["error"]
    return result["value"]


def load_graph(data: bytes) -> Any:
    """The model from ``dump_graph``'s bytes. Only ever called on bytes from an authenticated peer."""
    import cloudpickle

    return cloudpickle.loads(data)


def _new_variable(cls: type, meta: dict[str, Any], value: Any) -> Any:
    v = cls.__new__(cls)
    v.__dict__.update(meta)
    if isinstance(value, tuple):  # (shape, dtype): the value travels apart and is assigned later
        value = np.zeros(value[0], dtype=value[1])
    v._initialize(value)
    return v


def _torch_parameter(variable: Any) -> Any:
    """The torch parameter a Keras variable holds on the torch backend (None elsewhere)."""
    torch = sys.modules.get("torch")
    value = getattr(variable, "_value", None)
    return value if torch is not None and isinstance(value, torch.nn.Parameter) else None


def _made_functional(cls: type) -> bool:
    """Whether ``cls`` is a Model subclass that Keras made functional: one whose ``__init__`` passed inputs and
    outputs swaps its base ``Model`` for ``Functional`` (keras' ``inject_functional_model_class``)."""
    from keras.src.models.functional import Functional

    return issubclass(cls, Functional) and cls is not Functional


def _new_functional(cls: type) -> Any:
    """An empty instance of ``cls`` made functional here as in the sender: a class imported by name has its base
    swapped only in a process that constructed one."""
    from keras.src.models.functional import Functional
    from keras.src.models.model import inject_functional_model_class

    if not issubclass(cls, Functional):
        inject_functional_model_class(cls)
    return cls.__new__(cls)


def _set_dict(obj: Any, state: dict[str, Any]) -> None:
    obj.__dict__.update(state)


def _set_optimizer(obj: Any, state: dict[str, Any]) -> None:
    for key, value in state.items():
        if isinstance(value, _ByVariable):
            state[key] = value.rekeyed(obj)
    obj.__dict__.update(state)


def _set_tracker(obj: Any, state: dict[str, Any]) -> None:
    obj.__dict__.update(state)
    obj.__dict__["stored_ids"] = {name: {id(x) for x in store} for name, (_, store) in obj.config.items()}


def _set_tracked(obj: Any, state: tuple[dict[str, Any], Any]) -> None:
    attrs, items = state
    obj.__dict__.update(attrs)
    # The container's own methods would track again: fill it as the plain type it is.
    if isinstance(obj, list):
        list.extend(obj, items)
    elif isinstance(obj, dict):
        dict.update(obj, items)
    else:
        set.update(obj, items)


class _Gone:
    pass


def _weak(target: Any) -> Any:
    return weakref.ref(target if target is not None else _Gone())


def _absent() -> None:
    return None


def _tf_function(python_function: Any, signature: Any) -> Any:
    import tensorflow as tf

    return tf.function(python_function, input_signature=signature)


class _ByVariable:
    """A dict or set an optimizer keys by its variables' process-local keys, keyed again on arrival."""

    def __init__(self, kind: str, pairs: list[tuple[Any, Any]]) -> None:
        self.kind, self.pairs = kind, pairs

    def rekeyed(self, opt: Any) -> Any:
        if self.kind == "set":
            return {opt._var_key(v) for v, _ in self.pairs}
        return {opt._var_key(v): value for v, value in self.pairs}


def _var_keys(model: Any) -> dict[Any, Any]:
    """Each optimizer's key of each variable it may have seen -> the variable."""
    variables = list(model.variables)
    opts = optimizers_of(model)
    for opt in opts:
        variables += list(getattr(opt, "_trainable_variables", []) or [])
    keys: dict[Any, Any] = {}
    for opt in opts:
        for v in variables:
            keys[opt._var_key(v)] = v
    return keys


def _by_variable(value: Any, keys: dict[Any, Any]) -> Any:
    if not isinstance(value, (cabc.Mapping, cabc.Set)) or not value:
        return value
    try:
        if not all(isinstance(k, (int, str)) and k in keys for k in value):
            return value
    except TypeError:
        return value
    if isinstance(value, cabc.Set):
        return _ByVariable("set", [(keys[k], None) for k in value])
    return _ByVariable("dict", [(keys[k], v) for k, v in value.items()])


def untracked(value: Any) -> Any:
    """``value`` with TensorFlow's tracking wrappers made the plain lists, tuples (namedtuples kept) and dicts
    they wrap, at every depth (Keras' ``tree`` takes a ``ListWrapper`` for a node of another type, a
    ``_TupleWrapper`` for a leaf); ``value`` itself where it holds none."""
    wrapper = _tf_tracked_type()
    wrapped = wrapper is not None and isinstance(value, wrapper)
    if isinstance(value, cabc.Mapping) and (wrapped or isinstance(value, dict)):
        items = {k: untracked(v) for k, v in value.items()}
        changed = wrapped or any(items[k] is not v for k, v in value.items())
        return dict(items) if changed else value
    if isinstance(value, (list, tuple)) or (wrapped and isinstance(value, cabc.Sequence)):
        parts = [untracked(v) for v in value]
        if not wrapped and all(p is v for p, v in zip(parts, value)):
            return value
        if isinstance(value, tuple):  # a _TupleWrapper's __class__ is the wrapped tuple's
            return value.__class__._make(parts) if hasattr(value, "_fields") else tuple(parts)
        return parts
    return value


def _tf_tracked_type() -> type | None:
    tf = sys.modules.get("tensorflow")
    if tf is None:  # another backend: nothing is wrapped
        return None
    from tensorflow.python.trackable.data_structures import TrackableDataStructure

    return TrackableDataStructure


def _same(value: Any) -> Any:
    return value


def _is_tf_resource(obj: Any) -> bool:
    tf = sys.modules.get("tensorflow")
    if tf is None:  # another backend: no TensorFlow resources to hold
        return False
    from tensorflow.python.trackable.resource import CapturableResource

    if isinstance(obj, CapturableResource):
        return True
    return isinstance(obj, tf.Tensor) and obj.dtype == tf.resource


def _tf_function_type() -> type | None:
    tf = sys.modules.get("tensorflow")
    return None if tf is None else tf.types.experimental.PolymorphicFunction


def _tf_strategy_type() -> type | None:
    tf = sys.modules.get("tensorflow")
    return None if tf is None else tf.distribute.Strategy


def _current_strategy() -> Any:
    import tensorflow as tf

    return tf.distribute.get_strategy()


def _cloudpickler() -> type:
    import cloudpickle

    return cloudpickle.Pickler


class _GraphPickler(_cloudpickler()):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.apart: set[int] = set()  # variables whose values travel apart
        self.apart_tensors: set[int] = set()  # their torch parameters
        self.var_keys: dict[Any, Any] = {}
        self.classes = _keras_classes()
        self.tf_function = _tf_function_type()
        self.tf_strategy = _tf_strategy_type()
        self.tf_tracked = _tf_tracked_type()

    def reducer_override(self, obj: Any) -> Any:
        """How each process-bound object travels:

        - a backend variable as its metadata, and its value unless it is in ``values_apart``; made anew on arrival;
        - an optimizer's tables keyed by its variables' process-local ids (``_var_key``) are keyed again by the
          new variables;
        - a layer tracker's id sets are rebuilt from the objects it holds;
        - compiled step functions are dropped (Keras makes them again on the first step), and so are the losses
          a layer's last call added (an evaluate's traced call leaves graph tensors there);
        - TensorFlow's tracking wrappers (``ListWrapper``, ``_TupleWrapper``, ``_DictWrapper``, such as
          ``compile``'s ``loss`` on that backend) travel as the plain structure Keras was given (``untracked``);
        - a TensorFlow resource (a lookup table) is restored by its layer from its assets (``save_assets``);
        - a variable's layout (a ``keras.distribution``'s placement) is dropped: the receiver places it itself;
        - a torch tensor travels as a numpy array, made again on the receiver's device (a model built on a GPU
          trains on workers without one); a torch layer's ``_torch_params`` is remade from the variables;
        - a Keras variable on torch travels with its torch parameter itself, so whatever else holds that
          parameter (a ``TorchModuleWrapper``'s module) holds the new variable's on arrival.
        """
        variable, saveable, tracking, optimizer = self.classes
        kind = type(obj)
        if isinstance(obj, variable):
            meta = {k: v for k, v in vars(obj).items() if k != "_value" and k not in _TF_BOOKKEEPING}
            if meta.get("_layout") is not None:  # a keras.distribution's placement on this process's devices
                meta["_layout"] = None
            parameter = _torch_parameter(obj)
            if parameter is not None:  # the same object wherever it is held (pickle's memo): see above
                return _new_variable, (kind, meta, parameter)
            value = np.asarray(obj.numpy())
            return _new_variable, (kind, meta, (value.shape, value.dtype.str) if id(obj) in self.apart else value)
        if isinstance(obj, saveable):
            state = {k: (None if k in _DROPPED else v) for k, v in vars(obj).items() if k not in _TF_BOOKKEEPING}
            for key, value in state.items():
                if _is_tf_resource(value):  # restored from the layer's assets (save_assets)
                    state[key] = None
                elif key in _CALL_LOSSES:  # the last call's, cleared by the next (a traced one's are graph tensors)
                    state[key] = set() if isinstance(value, cabc.Set) else []
            if isinstance(obj, optimizer):
                state = {k: _by_variable(v, self.var_keys) for k, v in state.items()}
                return copyreg.__newobj__, (kind,), state, None, None, _set_optimizer
            made = (_new_functional, (kind,)) if _made_functional(kind) else (copyreg.__newobj__, (kind,))
            return *made, without_torch_params(state), None, None, _set_dict
        if isinstance(obj, tracking.Tracker):
            return copyreg.__newobj__, (kind,), dict(vars(obj)), None, None, _set_tracker
        if isinstance(obj, (tracking.TrackedList, tracking.TrackedDict, tracking.TrackedSet)):
            items = dict(obj) if isinstance(obj, dict) else list(obj)
            return copyreg.__newobj__, (kind,), (dict(vars(obj)), items), None, None, _set_tracked
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):  # only arrays cross: no device, no storage
            if id(obj) in self.apart_tensors:  # its value travels apart and is assigned later
                return empty_tensor, tensor_layout(obj)
            return tensor_from_array, tensor_as_array(obj)
        if kind is weakref.ReferenceType:
            return _weak, (obj(),)
        if kind.__name__ == "DynamicBackend" and kind.__module__.startswith("keras"):
            return kind, (obj._backend,)  # its __getattr__ recurses while unpickling by state
        if _is_tf_resource(obj):
            return _absent, ()
        if self.tf_tracked is not None and isinstance(obj, self.tf_tracked) and isinstance(
                obj, (cabc.Mapping, cabc.Sequence)):  # the plain structure Keras was given
            return _same, (untracked(obj),)
        if self.tf_strategy is not None and isinstance(obj, self.tf_strategy):
            return _current_strategy, ()  # the receiving process's own (a copy would refuse new variables)
        if self.tf_function is not None and isinstance(obj, self.tf_function):
            return _tf_function, (obj.python_function, obj.input_signature)
        return super().reducer_override(obj)


def unpicklable_part(model: Any) -> str | None:
    """Where in the model the first object that cannot be pickled sits, e.g. "layer Logger, attribute
    stream (TextIOWrapper)"; None if every part pickles on its own."""
    _, saveable, tracking, _ = _keras_classes()
    seen: set[int] = set()

    class _Alone(_GraphPickler):  # one attribute on its own: the Keras objects it reaches are visited apart
        def persistent_id(self, obj: Any) -> Any:
            return id(obj) if isinstance(obj, saveable) else None

    def fails(value: Any) -> bool:
        pickler = _Alone(io.BytesIO(), protocol=5)
        try:
            pickler.dump(value)
            return False
        except Exception:
            return True

    def visit(obj: Any, owner: str) -> str | None:
        if id(obj) in seen:
            return None
        seen.add(id(obj))
        leaves = []
        for key, value in vars(obj).items():
            if key in _TF_BOOKKEEPING or key in _DROPPED or isinstance(value, tracking.Tracker):
                continue
            items = list(value.values()) if isinstance(value, dict) else value
            items = list(items) if isinstance(items, (list, tuple)) else [value]
            for item in items:
                if isinstance(item, saveable):  # the parts first: the innermost owner is named
                    found = visit(item, f"{_kind(item)} {type(item).__name__}")
                    if found is not None:
                        return found
                else:
                    leaves.append((key, item))
        for key, item in leaves:
            if fails(item):
                return f"{owner}, attribute {key.lstrip('_')} ({type(item).__name__})"
        return None

    return visit(model, f"{_kind(model)} {type(model).__name__}")


def _kind(obj: Any) -> str:
    import keras

    if isinstance(obj, keras.Model):
        return "model"
    if isinstance(obj, keras.layers.Layer):
        return "layer"
    if isinstance(obj, keras.optimizers.Optimizer):
        return "optimizer"
    return "object"


# -- resources and assets ------------------------------------------------------------
def check_resources(model: Any) -> str | None:
    """The first layer that holds a TensorFlow resource it cannot restore (no load_assets), if any."""
    for layer in model._flatten_layers():
        if hasattr(layer, "load_assets"):
            continue
        for key, value in vars(layer).items():
            if _is_tf_resource(value):
                return f"layer {layer.name!r} ({type(layer).__name__}) holds a TensorFlow resource in {key!r}"
    return None


def has_assets(model: Any) -> bool:
    return any(hasattr(layer, "save_assets") for layer in model._flatten_layers())


def save_assets(model: Any) -> bytes | None:
    """Every layer's assets (lookup vocabularies), as Keras saves them, in one zip; None if none."""
    if not has_assets(model):
        return None
    buf = io.BytesIO()
    with tempfile.TemporaryDirectory(prefix="nbdist-assets-") as root, \
            zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for i, layer in enumerate(model._flatten_layers()):
            if not hasattr(layer, "save_assets"):
                continue
            folder = os.path.join(root, str(i))
            os.makedirs(folder)
            with _vocabulary_as_asset(layer):
                layer.save_assets(folder)
            for name in sorted(os.listdir(folder)):
                archive.write(os.path.join(folder, name), f"{i}/{name}")
    return buf.getvalue()


def load_assets(model: Any, blob: bytes | None) -> None:
    """Each layer's assets back, through its own load_assets (which remakes its lookup table)."""
    if not blob:
        return
    with tempfile.TemporaryDirectory(prefix="nbdist-assets-") as root:
        with zipfile.ZipFile(io.BytesIO(blob)) as archive:
            names = archive.namelist()
            for name in names:
                index, _, base = name.partition("/")
                if not index.isdigit() or not base or "/" in base or base.startswith("."):
                    raise ValueError(f"unexpected asset path {name!r}")
            archive.extractall(root)
        for i, layer in enumerate(model._flatten_layers()):
            if hasattr(layer, "load_assets"):
                folder = os.path.join(root, str(i))
                os.makedirs(folder, exist_ok=True)
                with _vocabulary_as_asset(layer):
                    layer.load_assets(folder)


@contextlib.contextmanager
def _vocabulary_as_asset(layer: Any) -> Iterator[None]:
    """A lookup layer given its vocabulary at construction (``StringLookup(vocabulary=[...])``) keeps it in its
    config, and Keras' ``save_assets`` and ``load_assets`` skip it; the model travels without configs, so for
    the length of one such call the layer's vocabulary is an asset, as an adapted layer's is."""
    given = getattr(layer, "input_vocabulary", None)
    if given is None:
        yield
        return
    layer.input_vocabulary = None
    try:
        yield
    finally:
        layer.input_vocabulary = given
