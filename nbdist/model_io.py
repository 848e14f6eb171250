"""Keras model <-> portable spec: JSON config (with compile config), weights, optimizer state, notebook objects.

How a model travels. The driver serialises the model to Keras's JSON config while
recording every object in it that a worker could not import: functions and classes
defined in the notebook (losses, metrics, layers, activations, schedules, models
with their own ``train_step``...) and the functions of ``Lambda`` layers. Those
travel by value, cloudpickled, each under a key the config names; a layer without
``get_config()`` travels as its class and constructor arguments (captured when it
was made, see ``capture_constructor_args``). The driver rebuilds the model from
that spec in-process before any worker starts, so a model that would not come out
the same on a worker is one sentence here. Weights, optimizer slots and the
optimizer's step count always travel as raw arrays, so a trained model continues
where it was. A worker unpickles the notebook objects only after the connection
has been authenticated (see wire/protocol.py).
"""
from __future__ import annotations

import contextlib
import copy
import importlib
import importlib.abc
import importlib.machinery
import json
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import NbdistError

# Where a config names a notebook object shipped by value: its key in the custom objects.
_KEY_PREFIX = "nbdist>"
_OPERATION_MODULE = "keras.src.ops.operation"
_INIT_ARGS = "_nbdist_init_args"


@dataclass
class ModelSpec:
    config: dict[str, Any]
    weights: list[np.ndarray]
    optimizer_weights: list[np.ndarray] | None = None
    custom_objects: bytes | None = None  # cloudpickled dict key -> object
    iterations: int | None = None  # the optimizer's step count: a trained model keeps counting


def is_keras_model(obj: Any) -> bool:
    keras = _keras_if_loaded()
    return keras is not None and isinstance(obj, keras.Model)


def _keras_if_loaded() -> Any:
    return sys.modules.get("keras")


def check_trainable(model: Any, name: str = "model") -> None:
    if not is_keras_model(model):
        raise NbdistError(f"{name} is a {type(model).__name__}, not a Keras model; pass a keras.Model.")
    if not getattr(model, "compiled", False) or getattr(model, "optimizer", None) is None:
        raise NbdistError(
            f"{name} is not compiled; call {name}.compile(optimizer, loss, metrics=[...]) in the cell."
        )
    if not model.built:
        raise NbdistError(
            f"{name} has no weights yet; give it an input shape, e.g. keras.Input((64,)) as its first layer."
        )


def ensure_built(model: Any, x: Any, y: Any) -> None:
    """Create every weight now, as ``fit``'s first step would: a subclassed model built with
    ``model.build(shape)`` has no weights in its inner layers until it is called."""
    if all(layer.built for layer in model._flatten_layers()):
        return
    if x is None:  # the rows are elsewhere (a Spark DataFrame): build from the shape given to build()
        row = _row_from_build_shape(model)
        if row is None:
            return  # no complete shape recorded: each worker builds the model on its own rows
        try:
            model(row)  # no label here: the layers' weights are what must exist before launch
        except Exception as exc:
            raise NbdistError(f"the model could not be built on a zero row of the shape given to build() "
                              f"({_one_line(exc)}); call it once on real rows before training.") from None
        return
    try:
        model._symbolic_build(data_batch=(x[:1], None if y is None else y[:1]))
    except Exception as exc:
        raise NbdistError(f"the model could not be built on one row of the training data ({_one_line(exc)}); "
                          "check that the data fits the model's call().") from None


def _row_from_build_shape(model: Any) -> np.ndarray | None:
    """One zero row of the input shape passed to ``model.build(shape)``, if it was one complete shape."""
    shapes = getattr(model, "_build_shapes_dict", None) or {}
    if len(shapes) != 1:
        return None
    shape = next(iter(shapes.values()))
    if not isinstance(shape, (tuple, list)) or len(shape) < 2 or any(
            not isinstance(d, int) for d in shape[1:]):
        return None
    return np.zeros((1, *shape[1:]), dtype="float32")


def averaged_optimizer_variables(model: Any) -> list[Any]:
    """Optimizer state worth averaging: float slots, not step counters or the learning rate."""
    opt = model.optimizer
    out = []
    for v in opt.variables:
        path = getattr(v, "path", v.name)
        if "float" not in str(v.dtype) or path.endswith("learning_rate") or path.endswith("iteration"):
            continue
        out.append(v)
    return out


def build_optimizer(model: Any) -> None:
    """Create optimizer slots now, so every worker has the same variables before training."""
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def optimizer_steps(model: Any) -> int | None:
    try:
        return int(np.asarray(model.optimizer.iterations))
    except Exception:  # an optimizer without a step counter
        return None


# -- driver: model -> spec -----------------------------------------------------
def spec_from_model(model: Any, namespace: dict[str, Any] | None = None) -> ModelSpec:
    """The model as it travels to train; one sentence if it cannot, before any worker starts."""
    return travelling_model(model, namespace)[0]


def travelling_model(model: Any, namespace: dict[str, Any] | None = None, *,
                     optimizer: bool = True) -> tuple[ModelSpec, dict[str, Any]]:
    """The spec and the notebook objects it needs (by key); without ``optimizer``, for inference."""
    if optimizer:
        check_trainable(model)
    config, custom = portable_config(model, namespace)
    blob = _pickle(custom)
    opt_weights = None
    if optimizer and model.optimizer.built:
        opt_weights = [np.asarray(v.numpy()) for v in averaged_optimizer_variables(model)]
    spec = ModelSpec(config, [np.asarray(w) for w in model.get_weights()], opt_weights, blob,
                     optimizer_steps(model) if optimizer else None)
    _check_round_trip(model, spec, custom)
    return spec, custom


def portable_config(model: Any, namespace: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keras's JSON config of the model and the notebook objects it names, by key."""
    custom: dict[str, Any] = {}
    try:
        from keras.src.saving import serialization_lib

        with _recording(custom):
            raw = serialization_lib.serialize_keras_object(model)  # the wrapped one, for the model itself too
        config = json.loads(json.dumps(raw, default=_json_default))
    except NbdistError:
        raise
    except Exception as exc:
        raise NbdistError(f"the model cannot be described for the workers ({_one_line(exc)}); "
                          "give the custom layer named there a get_config() method.") from None
    for name, obj in _custom_objects(config, namespace or {}).items():
        custom.setdefault(name, obj)
    return config, custom


class _Replay:
    """A layer without get_config(): made again on the worker from its class and constructor arguments."""

    def __init__(self, cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def from_config(self, config: dict[str, Any]) -> Any:
        return self.cls(*self.args, **self.kwargs)


@contextlib.contextmanager
def _recording(custom: dict[str, Any]) -> Iterator[None]:
    """Serialise with Keras, recording the objects a worker could not import.

    Keras serialises nested objects through ``serialization_lib.serialize_keras_object``,
    looked up at call time, so wrapping it there sees every layer, loss, metric and function."""
    from keras.src.saving import serialization_lib

    original = serialization_lib.serialize_keras_object

    def serialize(obj: Any) -> Any:
        replay = _replay_config(obj, custom)
        if replay is not None:
            return replay
        if isinstance(obj, types.FunctionType) and not _importable_object(obj):
            return _by_value(obj, custom)
        config = original(obj)
        if isinstance(config, dict) and "class_name" in config and not isinstance(obj, type):
            cls = type(obj)
            if not _importable_object(cls) and hasattr(cls, "from_config"):
                key = config.get("registered_name") or config["class_name"]
                custom[key] = cls
            _lambda_functions(obj, config, custom)
        return config

    serialization_lib.serialize_keras_object = serialize
    try:
        yield
    finally:
        serialization_lib.serialize_keras_object = original


def _by_value(fn: Any, custom: dict[str, Any]) -> dict[str, Any]:
    """A notebook function or lambda as a reference to its pickled self."""
    key = f"{_KEY_PREFIX}{fn.__qualname__}#{len(custom)}"
    custom[key] = fn
    return {"module": None, "class_name": "function", "config": key, "registered_name": key}


def _lambda_functions(obj: Any, config: dict[str, Any], custom: dict[str, Any]) -> None:
    """A Lambda layer's functions by value (closures and globals intact), not as marshalled bytecode,
    which Keras's safe mode refuses to load."""
    keras = _keras_if_loaded()
    if keras is None or not isinstance(obj, keras.layers.Lambda):
        return
    inner = config.get("config", {})
    for field, value in (("function", obj.function), ("output_shape", getattr(obj, "_output_shape", None)),
                         ("mask", getattr(obj, "mask", None))):
        if callable(value) and isinstance(inner.get(field), dict):
            inner[field] = _by_value(value, custom)


def _replay_config(obj: Any, custom: dict[str, Any]) -> dict[str, Any] | None:
    keras = _keras_if_loaded()
    if keras is None or not isinstance(obj, keras.layers.Layer):
        return None
    try:
        obj.get_config()
        return None
    except NotImplementedError:
        pass
    captured = obj.__dict__.get(_INIT_ARGS)
    if captured is None:
        raise NbdistError(
            f"layer {obj.name!r} ({type(obj).__name__}) has no get_config() and was made before nbdist was "
            f"imported, so its constructor arguments are unknown; import nbdist (or %load_ext nbdist) before "
            f"building the model, or give {type(obj).__name__} a get_config() method.")
    key = f"{_KEY_PREFIX}{type(obj).__qualname__}#{len(custom)}"
    args, kwargs = captured
    custom[key] = _Replay(type(obj), args, kwargs)
    config: dict[str, Any] = {"module": None, "class_name": key, "config": {}, "registered_name": key}
    build = obj.get_build_config() if hasattr(obj, "get_build_config") else None
    if build is not None:
        config["build_config"] = build
    if isinstance(obj, keras.Model) and getattr(obj, "compiled", False):
        config["compile_config"] = obj.get_compile_config()
    return config


def _importable_object(obj: Any) -> bool:
    """Whether a worker finds this function or class by module and name (a lambda, a function
    defined inside another or anything from the notebook's __main__ it does not)."""
    qualname = getattr(obj, "__qualname__", "")
    return "<lambda>" not in qualname and "<locals>" not in qualname and _importable(obj.__module__)


def _pickle(custom: dict[str, Any]) -> bytes | None:
    """The notebook objects, cloudpickled; one sentence naming any that cannot travel."""
    if not custom:
        return None
    import cloudpickle

    for key, obj in custom.items():
        parts = ([(f"argument {i + 1}", a) for i, a in enumerate(obj.args)] + list(obj.kwargs.items())
                 if isinstance(obj, _Replay) else [("", obj)])
        for part, value in parts:
            try:
                cloudpickle.dumps(value)
            except Exception as exc:
                what = _describe(key, obj) + (f", {part} ({type(value).__name__})" if part else "")
                raise NbdistError(f"{what} cannot be sent to the workers ({_one_line(exc)}); create it inside "
                                  "the function or layer, or pass what it is made from instead.") from None
    return cloudpickle.dumps(custom)


def _describe(key: str, obj: Any) -> str:
    if isinstance(obj, _Replay):
        return f"layer {obj.cls.__name__}"
    if isinstance(obj, type):
        return f"class {obj.__name__}"
    return f"function {getattr(obj, '__qualname__', key)}"


def _check_round_trip(model: Any, spec: ModelSpec, custom: dict[str, Any]) -> None:
    """Rebuild the model here as a worker will, and compare its weights' structure."""
    import cloudpickle

    try:
        rebuilt = model_from_spec(spec, cloudpickle.loads(spec.custom_objects) if spec.custom_objects else None,
                                  weights=False)
    except NbdistError:
        raise
    except Exception as exc:
        raise NbdistError(f"the model does not rebuild from its description ({_one_line(exc)}); give its "
                          "custom layers and models a get_config() that returns their constructor "
                          "arguments.") from None
    want = [(tuple(w.shape), str(w.dtype)) for w in spec.weights]
    got = [(tuple(w.shape), str(np.dtype(w.dtype))) for w in rebuilt.get_weights()]
    if got != want:
        raise NbdistError(f"the model rebuilds with {len(got)} weights of other shapes than its {len(want)} "
                          f"({_first_difference(got, want)}); give its custom layers a build() that creates "
                          "every weight from the input shape.")


def _first_difference(got: list[Any], want: list[Any]) -> str:
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return f"weight {i}: {g} instead of {w}"
    return f"{abs(len(got) - len(want))} weights {'more' if len(got) > len(want) else 'fewer'}"


# -- worker: spec -> model -----------------------------------------------------
def model_from_spec(spec: ModelSpec, custom_objects: dict[str, Any] | None = None, *, weights: bool = True) -> Any:
    from keras.saving import deserialize_keras_object

    # A copy: Keras writes deserialised objects back into the config it is given (Lambda does).
    model = deserialize_keras_object(copy.deepcopy(spec.config), custom_objects=custom_objects or {})
    if not weights:
        return model
    model.set_weights(spec.weights)
    if spec.optimizer_weights is not None:
        build_optimizer(model)
        set_optimizer_weights(model, spec.optimizer_weights)
    if spec.iterations:  # Adam's bias correction and learning-rate schedules continue, not restart
        model.optimizer.iterations.assign(int(spec.iterations))
    return model


def set_optimizer_weights(model: Any, values: list[np.ndarray]) -> None:
    variables = averaged_optimizer_variables(model)
    if len(variables) != len(values):
        raise ValueError(f"optimizer has {len(variables)} state variables, got {len(values)} values")
    for v, value in zip(variables, values):
        v.assign(value)


# -- constructor arguments of layers without get_config ------------------------
def capture_constructor_args() -> None:
    """Keep the constructor arguments of every Keras layer Keras itself could not keep (its automatic
    config takes plain values only), so a layer without get_config() can be made again on a worker.

    Hooks ``Operation.__new__`` when Keras is imported (now, or later through an import hook)."""
    module = sys.modules.get(_OPERATION_MODULE)
    if module is not None:
        _wrap_new(module.Operation)
    elif not any(isinstance(f, _OperationHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _OperationHook())


def _wrap_new(operation: type) -> None:
    original = operation.__new__
    if getattr(original, "_nbdist", False):
        return

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        instance = original(cls, *args, **kwargs)
        if getattr(instance, "_auto_config", None) is None:
            vars(instance)[_INIT_ARGS] = (args, dict(kwargs))  # vars(): past Keras's attribute tracking
        return instance

    __new__._nbdist = True  # type: ignore[attr-defined]
    operation.__new__ = staticmethod(__new__)


class _OperationHook(importlib.abc.MetaPathFinder):
    """Wraps Operation.__new__ right after Keras defines it."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _OPERATION_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module: types.ModuleType) -> None:
            exec_module(module)
            _wrap_new(module.Operation)

        spec.loader.exec_module = exec_and_wrap  # type: ignore[method-assign]
        return spec


# -- helpers -------------------------------------------------------------------
def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 160 else text[:157] + "..."


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _custom_objects(config: Any, namespace: dict[str, Any]) -> dict[str, Any]:
    """Objects the config names that a worker could not import and that were not recorded while
    serialising: classes found by name in the notebook, and its registered custom objects."""
    found: dict[str, Any] = {}

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            module = node.get("module")
            name = node.get("registered_name") or node.get("class_name")
            # Keras writes module None for classes it cannot place, e.g. ones defined in a notebook.
            if (isinstance(name, str) and "class_name" in node and not name.startswith(_KEY_PREFIX)
                    and node.get("class_name") != "function" and not _importable(module)):
                obj = _lookup(name, namespace)
                if obj is not None:
                    found[name] = obj
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(config)
    try:
        from keras.saving import get_custom_objects

        for name, obj in get_custom_objects().items():
            if getattr(obj, "__module__", "") == "__main__":
                found.setdefault(name, obj)
    except ImportError:
        pass
    return found


def _importable(module: str | None) -> bool:
    if not isinstance(module, str) or module == "__main__":
        return False
    if module in ("builtins",) or module.startswith("keras"):
        return True
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


def _lookup(name: str, namespace: dict[str, Any]) -> Any:
    short = name.split(">")[-1]
    if short in namespace:
        return namespace[short]
    import __main__

    return getattr(__main__, short, None)
