"""Whether labels can be the targets of a model's loss, decided by Keras itself, before any worker starts.

Keras' rules for which label shapes a loss takes are many (a class id per row, per time step or per
pixel for the sparse losses, a trailing axis of 1 squeezed or added, broadcasting for the regression
losses, the same shape for the cross-entropies, a structure of labels per output by name or position),
so they are not written again here: the model's own loss (what ``compile`` got, Keras' ``CompileLoss``
around it) is computed once on the labels' first rows and stand-in predictions of the outputs' shapes.
Where Keras raises, so would the local ``fit``, and its reason is what the user reads. Only for losses
Keras ships: a notebook's own loss function is the user's code, judged where it runs, on the workers.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

ROWS = 2  # enough for every reduction; what it costs does not grow with the data


def loss_refusal(model: Any, y: Any, sample_weight: Any = None) -> str | None:
    """Keras' reason, in one line, why ``y`` (with ``sample_weight``) cannot be the targets of the model's
    compiled loss; None when Keras takes them, or when it cannot be told without running the user's code."""
    loss = getattr(model, "loss", None)
    if loss is None or y is None or not _keras_losses_only(loss):
        return None
    predictions = _stand_in_predictions(model)
    if predictions is None:
        return None
    try:
        from keras.src.trainers.compile_utils import CompileLoss
    except ImportError:  # another Keras layout: the workers' fit will tell
        return None
    try:
        compiled = CompileLoss(loss, output_names=getattr(model, "output_names", None))
        compiled(_first_rows(y), predictions, sample_weight=_first_rows(sample_weight))
    except Exception as exc:  # Keras' own refusal: ValueError, KeyError, TypeError, or the backend's error
        return _one_line(exc)
    return None


def _keras_losses_only(loss: Any) -> bool:
    """Every loss in ``compile``'s ``loss`` is Keras' own (a name, or one of its functions or classes)."""
    if isinstance(loss, dict):
        return all(_keras_losses_only(v) for v in loss.values())
    if isinstance(loss, (list, tuple)):
        return all(_keras_losses_only(v) for v in loss)
    if loss is None or isinstance(loss, str):
        return True
    module = getattr(loss, "__module__", None) or type(loss).__module__
    return str(module).startswith("keras")


def _stand_in_predictions(model: Any) -> Any:
    """Arrays of 0.5 shaped and structured as the model's outputs (``ROWS`` rows); None when a
    dimension is unknown or the model has no symbolic outputs (a subclassed model)."""
    try:
        outputs = getattr(model, "_outputs_struct", None)
        if outputs is None:
            outputs = model.outputs[0] if len(model.outputs) == 1 else list(model.outputs)
    except (AttributeError, ValueError, TypeError):
        return None
    import keras

    flat = keras.tree.flatten(outputs)
    if not flat or any(d is None for t in flat for d in tuple(t.shape)[1:]):
        return None
    return keras.tree.map_structure(lambda t: np.full((ROWS, *tuple(t.shape)[1:]), 0.5, dtype=_dtype(t)), outputs)


def _dtype(tensor: Any) -> str:
    dtype = str(getattr(tensor, "dtype", "float32"))
    return dtype if dtype in ("float16", "float32", "float64") else "float32"  # bfloat16: numpy has none


def _first_rows(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: _first_rows(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_first_rows(v) for v in value)
    return np.asarray(value[:ROWS])


def _one_line(exc: BaseException) -> str:
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    text = re.sub(r"\{\{function_node [^}]*\}\}\s*", "", text)  # TensorFlow's op-placement prefix
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return " ".join(lines[:3]) if lines else type(exc).__name__
