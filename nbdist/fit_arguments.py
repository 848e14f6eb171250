"""One ``model.fit(...)`` call's arguments as a typed value: a cell's own call (driver/fit_call.py
``bind_fit``) or ``nbdist.train``'s (api.py ``fit_arguments``). Defaults are Keras' fit's; ``given`` names the
arguments the cell spelled out, which the magic line's options must agree with (driver/fit_call.py ``reconcile``).
Also Keras' own rules on them that several places apply: ``validates`` and ``check_count``."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

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
    def names(cls) -> set[str]:
        """fit's argument names."""
        return {f.name for f in dataclasses.fields(cls)} - {"given"}

    def replace(self, **changes: Any) -> FitCall:
        return dataclasses.replace(self, **changes)


def validates(epoch: int, validation_freq: int) -> bool:
    """Whether Keras' fit validates after 0-based ``epoch``: every ``validation_freq``-th epoch."""
    return (epoch + 1) % validation_freq == 0


def check_count(name: str, value: Any) -> None:
    """``steps_per_epoch``, ``validation_steps`` or ``validation_batch_size``: None or a whole number of at least 1,
    else one sentence."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
        raise NbdistError(f"{name} must be a whole number of at least 1 (or None), got {value!r}.")


__all__ = ["FitCall", "check_count", "validates"]
