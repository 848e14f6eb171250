"""Whether labels can be the targets of a model's loss, decided by Keras itself, before any worker starts.

Keras' rules for which label shapes a loss takes are many (class ids per row, time step or pixel for the
sparse losses, a trailing axis of 1 squeezed or added, broadcasting, a structure of labels per output), so
they are not written again here: the model's own loss (Keras' ``CompileLoss`` around what ``compile`` got)
is computed once on two rows of stand-ins with the given labels' and sample weights' shapes and dtypes
(class id 0, weight 1) and predictions of the outputs'. Where Keras raises, so would the local ``fit``, and
its reason is what the user reads. Only for losses Keras ships and a model without its own ``compute_loss``
or ``train_step``: a notebook's own loss or step is judged where it runs, on the workers.
"""
from __future__ import annotations

from typing import Any

import numpy as np

ROWS = 2  # enough for every reduction; what it costs does not grow with the data


def loss_refusal(model: Any, y: Any, sample_weight: Any = None) -> Exception | None:
    """What Keras raises (its type, its message) because ``y`` (with ``sample_weight``) cannot be the targets
    of the model's compiled loss; None when Keras takes them, or when it cannot be told without running the
    user's code."""
    from .graph import untracked

    loss = untracked(getattr(model, "loss", None))  # as compile got it, not as TensorFlow's tracking holds it
    if loss is None or y is None or not _keras_losses_only(loss) or _own_loss_step(model):
        return None
    rows = min([ROWS, *(len(a) for a in _leaves(y))])
    labels = _stand_in(y, rows, 0)
    if rows < 1 or labels is None:
        return None
    predictions = _stand_in_predictions(model, rows)
    if predictions is None:
        return None
    try:
        from keras.src.trainers.compile_utils import CompileLoss
    except ImportError:  # another Keras layout: the workers' fit will tell
        return None
    try:
        compiled = CompileLoss(loss, output_names=getattr(model, "output_names", None))
        compiled(labels, predictions, sample_weight=_stand_in(sample_weight, rows, 1))
    except Exception as exc:  # Keras' own refusal: ValueError, KeyError, TypeError, or the backend's error
        return exc
    return None


def _own_loss_step(model: Any) -> bool:
    """The model's class has its own ``compute_loss`` or ``train_step``: how the loss meets the outputs is the
    user's code (a ``compute_loss`` may split one output in two), judged where it runs."""
    import keras

    return any(getattr(type(model), name, None) is not getattr(keras.Model, name, None)
               for name in ("compute_loss", "train_step"))


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


def _stand_in_predictions(model: Any, rows: int) -> Any:
    """Arrays of 0.5 shaped and structured as the model's outputs (``rows`` rows); None when a
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
    return keras.tree.map_structure(lambda t: np.full((rows, *tuple(t.shape)[1:]), 0.5, dtype=_dtype(t)), outputs)


def _dtype(tensor: Any) -> str:
    dtype = str(getattr(tensor, "dtype", "float32"))
    return dtype if dtype in ("float16", "float32", "float64") else "float32"  # bfloat16: numpy has none


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [] if value is None else [value]


def _stand_in(value: Any, rows: int, fill: int) -> Any:
    """``value``'s structure, shapes and dtypes for ``rows`` rows, every entry ``fill``: the shapes are what
    this check is about (class id 0 and weight 1 are valid for every loss; the values are checked elsewhere,
    with their own sentences). None for labels that are not numbers (text labels have their own check)."""
    if value is None:
        return None
    if isinstance(value, dict):
        parts = {k: _stand_in(v, rows, fill) for k, v in value.items()}
        return None if any(v is None for v in parts.values()) else parts
    if isinstance(value, (list, tuple)):
        items = [_stand_in(v, rows, fill) for v in value]
        return None if any(v is None for v in items) else type(value)(items)
    shape = tuple(np.shape(value))
    if not shape or None in shape:  # ragged labels (data/ragged.py): no one shape to stand in for
        return None
    dtype = np.asarray(value[:1]).dtype
    if dtype.kind not in "biuf":
        return None
    return np.full((rows, *shape[1:]), fill, dtype=dtype)
