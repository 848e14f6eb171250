"""The validation pass's iterator, kept across epochs: validation data that yields its passes one after
another (``whole_passes``) is read through one iterator, a pass per validation.

On TensorFlow that saves making an iterator every epoch. On JAX and torch it is what makes the passes right:
Keras reads a generator through its adapter, which replays the 2 batches it peeked at at the start of every
pass and then reads on, so without one kept iterator every validation after the first read 2 batches twice
and missed 2 (the invariant: validation p reads exactly pass p's batches)."""
from __future__ import annotations

import logging
import types
import weakref
from typing import Any

import keras

log = logging.getLogger("nbdist.worker")

_WHOLE_PASSES: weakref.WeakSet[Any] = weakref.WeakSet()  # generators of passes (no attribute can be set on them)


def whole_passes(data: Any) -> Any:
    """Mark ``data`` (a repeated pipeline, or a generator of passes) as yielding one whole validation pass after
    another, ``validation_steps`` batches each; returns it."""
    if isinstance(data, types.GeneratorType):
        _WHOLE_PASSES.add(data)
    else:
        data.nbdist_one_pass_per_validation = True
    return data


def reads_whole_passes(dataset: Any) -> bool:
    """Whether ``dataset`` was marked by ``whole_passes``."""
    if isinstance(dataset, types.GeneratorType):
        return dataset in _WHOLE_PASSES
    return bool(getattr(dataset, "nbdist_one_pass_per_validation", False))


class KeepValidationIterator(keras.callbacks.Callback):
    """Validation reads ONE iterator for the whole fit, instead of a new one every epoch.

    ``evaluate`` drops its iterator at every call and makes a new one; deleting a tf.data
    iterator costs 2.5-5.6 ms here (measured, one core), 10-15% of the quickstart MLP's epoch
    on a worker. The repeated validation pipeline is read a whole pass (``validation_steps``
    batches) per epoch, so one iterator kept across epochs gives the same batches in the same
    order. At the first validation this makes Keras' evaluation iterator hand out that one
    iterator every time; with a Keras whose internals differ it does nothing, and Keras makes
    its own iterators as usual.
    """

    def __init__(self) -> None:
        super().__init__()
        self._kept: Any = None

    def on_test_begin(self, logs: Any = None) -> None:
        if self._kept is not None:
            return
        epochs = getattr(self.model, "_eval_epoch_iterator", None)
        make = getattr(epochs, "_get_iterator", None)
        if make is None or getattr(self.model, "_distribute_strategy", None) is not None:
            return  # not the Keras this was written for, or one that peeks a batch before each pass
        try:
            self._kept = _Same(iter(make()))
        except Exception:  # an optimisation only: Keras' own iterators still work
            log.debug("keeping Keras' per-epoch validation iterators", exc_info=True)
            return
        epochs._get_iterator = lambda: self._kept

    def on_train_end(self, logs: Any = None) -> None:
        self._kept = None


class _Same:
    """Iterating it gives the same iterator every time."""

    def __init__(self, iterator: Any) -> None:
        self.iterator = iterator

    def __iter__(self) -> Any:
        return self.iterator
