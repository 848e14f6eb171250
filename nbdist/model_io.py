"""Keras model <-> portable spec: JSON config (with compile config), weights, custom objects.

The config is plain JSON; weights are numpy arrays. Classes and functions the
user defined in the notebook cannot be imported by a worker, so they travel
cloudpickled, and a worker unpickles them only after the connection has been
authenticated (see protocol.py).
"""
from __future__ import annotations

import importlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import NbdistError

log = logging.getLogger(__name__)


@dataclass
class ModelSpec:
    config: dict[str, Any]
    weights: list[np.ndarray]
    optimizer_weights: list[np.ndarray] | None = None
    custom_objects: bytes | None = None  # cloudpickled dict name -> object


def is_keras_model(obj: Any) -> bool:
    keras = _keras_if_loaded()
    return keras is not None and isinstance(obj, keras.Model)


def _keras_if_loaded():
    import sys

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


def spec_from_model(model: Any, namespace: dict[str, Any] | None = None) -> ModelSpec:
    from keras.saving import serialize_keras_object

    check_trainable(model)
    try:
        config = json.loads(json.dumps(serialize_keras_object(model), default=_json_default))
    except Exception as exc:
        raise NbdistError(
            f"the model cannot be serialised ({exc}); give custom layers a get_config() method."
        ) from None
    custom = _custom_objects(config, namespace or {})
    blob = None
    if custom:
        import cloudpickle

        blob = cloudpickle.dumps(custom)
    opt_weights = None
    if model.optimizer.built:
        opt_weights = [np.asarray(v.numpy()) for v in averaged_optimizer_variables(model)]
    return ModelSpec(config, [np.asarray(w) for w in model.get_weights()], opt_weights, blob)


def model_from_spec(spec: ModelSpec, custom_objects: dict[str, Any] | None = None) -> Any:
    from keras.saving import deserialize_keras_object

    model = deserialize_keras_object(spec.config, custom_objects=custom_objects or {})
    model.set_weights(spec.weights)
    if spec.optimizer_weights is not None:
        build_optimizer(model)
        set_optimizer_weights(model, spec.optimizer_weights)
    return model


def set_optimizer_weights(model: Any, values: list[np.ndarray]) -> None:
    variables = averaged_optimizer_variables(model)
    if len(variables) != len(values):
        raise ValueError(f"optimizer has {len(variables)} state variables, got {len(values)} values")
    for v, value in zip(variables, values):
        v.assign(value)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def _custom_objects(config: Any, namespace: dict[str, Any]) -> dict[str, Any]:
    """Objects the config names that a worker could not import: the notebook's own classes."""
    found: dict[str, Any] = {}

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            module = node.get("module")
            name = node.get("registered_name") or node.get("class_name")
            # Keras writes module None for classes it cannot place, e.g. ones defined in a notebook.
            if isinstance(name, str) and "class_name" in node and not _importable(module):
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
