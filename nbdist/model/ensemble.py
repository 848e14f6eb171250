"""An ensemble of trained Keras models: one model whose prediction is the mean of its members' predictions.

For classifiers with probability outputs that mean is soft voting (what Elephas's ``best_ensemble`` returns);
for regressors it is the averaged estimate. The ensemble is an ordinary Keras model: ``predict``,
``evaluate``, ``%dist_evaluate``, ``%dist_predict``, ``save`` and ``keras.models.load_model`` take it (loading
needs nbdist imported, which registers the class). Members keep their own names and weights; they are not
copied, so an ensemble made from a search's models shares their variables.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import keras

from ..errors import NbdistError


@keras.saving.register_keras_serializable(package="nbdist")
class Ensemble(keras.Model):
    """The mean of ``members``' outputs (each output of a multi-output model averaged on its own)."""

    def __init__(self, members: Sequence[keras.Model], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.members = list(members)

    def call(self, inputs: Any, training: bool = False) -> Any:
        outputs = [member(inputs, training=training) for member in self.members]
        return keras.tree.map_structure(
            lambda *each: keras.ops.mean(keras.ops.stack([keras.ops.cast(o, "float32") for o in each]), axis=0),
            *outputs)

    def get_config(self) -> dict[str, Any]:
        return {"name": self.name, "members": [keras.saving.serialize_keras_object(m) for m in self.members]}

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None) -> Ensemble:
        config = dict(config)
        members = [keras.saving.deserialize_keras_object(m, custom_objects=custom_objects)
                   for m in config.pop("members")]
        return cls(members, **config)


def make_ensemble(models: Sequence[Any], name: str = "ensemble") -> Ensemble:
    """One model averaging ``models``' predictions, compiled as the first (best) member is, built on its
    inputs when they are known. The members must take the same inputs and give outputs of one shape."""
    models = list(models)
    if not models:
        raise NbdistError("an ensemble needs at least one trained model; the search has no complete trial yet.")
    for model in models:
        if not isinstance(model, keras.Model):
            raise NbdistError(f"an ensemble's members must be Keras models, got {type(model).__name__}.")
    shapes = [_output_shapes(m) for m in models]
    if any(s is not None and shapes[0] is not None and s != shapes[0] for s in shapes):
        raise NbdistError("the models to ensemble give outputs of different shapes "
                          f"({', '.join(str(s) for s in shapes)}); only models with the same outputs can be averaged.")
    ensemble = Ensemble(models, name=name)
    first = models[0]
    inputs = getattr(first, "inputs", None)
    if inputs:
        sample = keras.tree.map_structure(
            lambda t: keras.ops.zeros((1, *t.shape[1:]), dtype=t.dtype), _structured_inputs(first))
        ensemble(sample)  # builds it, so that it saves and summarises before any data reaches it
    compiled = first.get_compile_config() if getattr(first, "compiled", False) else None
    if compiled:
        ensemble.compile_from_config(compiled)
    return ensemble


def _structured_inputs(model: Any) -> Any:
    """The model's symbolic inputs as its call takes them (a dict for named inputs, a list, or one)."""
    structure = getattr(model, "_inputs_struct", None)
    if structure is not None:
        return structure
    inputs = model.inputs
    return inputs[0] if len(inputs) == 1 else inputs


def _output_shapes(model: Any) -> Any:
    outputs = getattr(model, "outputs", None)
    if not outputs:
        return None
    return tuple(tuple(o.shape[1:]) for o in outputs)


__all__ = ["Ensemble", "make_ensemble"]
