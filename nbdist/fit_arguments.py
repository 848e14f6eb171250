"""One ``model.fit(...)`` call's arguments as a typed value: a cell's own call (``FitCall.bind``) or
``nbdist.train``'s (``FitCall.of``). Defaults are Keras' fit's; ``given`` names the arguments the cell spelled
out, which the magic line's options must agree with (driver/fit_call.py ``reconcile``)."""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from .errors import NbdistError


@dataclass(frozen=True)
class FitCall:
    """``model.fit``'s arguments by name (Keras 3's signature), each defaulting as Keras' own fit."""

    x: Any = None
    y: Any = None
    batch_size: Any = None
    epochs: Any = 1
    verbose: Any = "auto"
    callbacks: Any = None
    validation_split: Any = 0.0
    validation_data: Any = None
    shuffle: Any = True
    class_weight: Any = None
    sample_weight: Any = None
    initial_epoch: Any = 0
    steps_per_epoch: Any = None
    validation_steps: Any = None
    validation_batch_size: Any = None
    validation_freq: Any = 1
    # The arguments a cell's model.fit(...) spelled out (empty for nbdist.train, whose options are its own).
    given: frozenset[str] = frozenset()

    @classmethod
    def bind(cls, model: Any, args: tuple[Any, ...], kwargs: dict[str, Any], sig: inspect.Signature) -> FitCall:
        """A cell's ``model.fit(*args, **kwargs)`` bound to Keras' own fit signature ``sig``."""
        try:
            bound = sig.bind(model, *args, **kwargs)
        except TypeError as exc:
            raise NbdistError(f"model.fit(...) {exc}; call it as you would without the magic.") from None
        given = set(bound.arguments) - {"self"}
        bound.apply_defaults()
        known = {f.name for f in dataclasses.fields(cls)} - {"given"}
        return cls(**{k: v for k, v in bound.arguments.items() if k in known}, given=frozenset(given))

    @classmethod
    def of(cls, x: Any, y: Any, *, epochs: int, shuffle: bool, **given: Any) -> FitCall:
        """``nbdist.train``'s (or ``--data X,y``'s) arguments: the options' epochs and shuffle, and what
        was passed (None meaning not passed)."""
        return cls(x=x, y=y, epochs=epochs, shuffle=shuffle, **{k: v for k, v in given.items() if v is not None})

    def replace(self, **changes: Any) -> FitCall:
        return dataclasses.replace(self, **changes)


__all__ = ["FitCall"]
