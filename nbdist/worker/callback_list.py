"""The worker's callback list: nbdist's own batch-end hooks run in order on the training thread, and Keras
never waits for the device to read a step's logs because of them.

Keras reads every step's logs as Python floats whenever a callback in its list has a batch-end hook not
marked ``async_safe``; on a GPU each read waits for the step, so the host can no longer queue the next one.
nbdist's hooks (pad steps, averaging rounds, metric sums, phase timers) read the batch index, never the
logs, and must run in order on the training thread, as their collectives pair up across workers. So
``WorkerCallbacks`` calls them itself before Keras' own dispatch, and Keras' list holds a stand-in for each
that forwards every other hook. A callback takes this road by setting ``batch_end_in_order = True``.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import keras

IN_ORDER = "batch_end_in_order"

# Every hook a stand-in forwards: all but the batch ends, which WorkerCallbacks calls itself.
_FORWARDED = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_test_begin",
              "on_test_end", "on_predict_begin", "on_predict_end", "on_train_batch_begin",
              "on_test_batch_begin", "on_predict_batch_begin")


def in_order(callback: Any) -> bool:
    """Whether ``callback``'s batch ends run in order on the training thread (``IN_ORDER``)."""
    return bool(getattr(callback, IN_ORDER, False))


def _forward(name: str) -> Callable[..., None]:
    def hook(self: _StandIn, *args: Any, **kwargs: Any) -> None:
        getattr(self.inner, name)(*args, **kwargs)

    hook.__name__ = name
    return hook


class _StandIn(keras.callbacks.Callback):
    """``inner`` in Keras' list: every hook forwarded but the batch ends (left Keras' defaults)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner = inner

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self.inner.set_model(model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)
        self.inner.set_params(params)


for _name in _FORWARDED:
    setattr(_StandIn, _name, _forward(_name))


class WorkerCallbacks(keras.callbacks.CallbackList):
    """Keras' callback list for a worker's fit (History included, no progress bar), with the ``IN_ORDER``
    callbacks' batch ends called here, in their order, on the training thread, without the step's logs."""

    def __init__(self, callbacks: Sequence[Any], model: Any, epochs: int, steps: int | None) -> None:
        self.in_order = [c for c in callbacks if in_order(c)]
        super().__init__([_StandIn(c) if in_order(c) else c for c in callbacks], add_history=True,
                         add_progbar=False, verbose=0, epochs=epochs, steps=steps, model=model)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        for callback in self.in_order:
            callback.on_train_batch_end(batch, None)
        super().on_train_batch_end(batch, logs)

    def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
        for callback in self.in_order:
            callback.on_test_batch_end(batch, None)
        super().on_test_batch_end(batch, logs)
