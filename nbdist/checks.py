"""Cheap checks that the model and the data fit together, and that training stays finite.

Run on the driver before any worker starts (a mismatch otherwise surfaces as a
TensorFlow traceback from a worker) and on every merged epoch (a loss that went
NaN or infinite ends the run with one sentence instead of training on garbage).
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .errors import NbdistError


def input_shape(model: Any) -> tuple[int, ...] | None:
    try:
        shape = tuple(model.inputs[0].shape[1:]) if len(model.inputs) == 1 else None
    except (AttributeError, ValueError, TypeError):
        return None
    return None if shape is None or any(d is None for d in shape) else tuple(int(d) for d in shape)


def _output_shape(model: Any) -> tuple[Any, ...] | None:
    try:
        return tuple(model.outputs[0].shape) if len(model.outputs) == 1 else None
    except (AttributeError, ValueError, TypeError):
        return None


def check_model_fits_data(model: Any, x: np.ndarray, y: np.ndarray | None, what: str = "training data") -> None:
    """One sentence if ``x`` cannot feed the model or ``y`` cannot be the target of its loss."""
    from .metrics import check_labels, classifier_spec, labels_are_classes

    expected = input_shape(model)
    if expected is not None and tuple(x.shape[1:]) != expected:
        raise NbdistError(f"the {what} features have shape {tuple(x.shape[1:])} per row but the model expects "
                          f"{expected}; pass data shaped like the model's input or change keras.Input.")
    out = _output_shape(model)
    if y is None or out is None:
        return
    loss = (model.get_compile_config() or {}).get("loss") if hasattr(model, "get_compile_config") else None
    check_labels(y.shape, out, loss, f"the {what} labels")
    spec = classifier_spec(loss, out)
    if spec is not None and spec.kind == "multiclass" and spec.sparse_labels and not labels_are_classes(y, spec):
        raise NbdistError(f"the {what} labels must be whole class ids from 0 to {spec.classes - 1} for this "
                          f"{spec.classes}-output model; check y or the model's last layer.")


def non_finite(logs: dict[str, Any]) -> str | None:
    """The first metric in a merged epoch's logs that is NaN or infinite, by name."""
    for key in sorted(logs, key=lambda k: (k != "loss", k)):  # the loss first: it is the cause
        value = logs[key]
        if isinstance(value, (int, float)) and not math.isfinite(value):
            return key
    return None


def non_finite_message(metric: str, value: float, epoch: int) -> str:
    return (f"training stopped: {metric} became {value} in epoch {epoch + 1}, so the weights diverged; lower the "
            "learning rate or scale the features, the model keeps its weights from before the run.")
