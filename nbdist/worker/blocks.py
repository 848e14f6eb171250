"""Several steps per call into TensorFlow, each call ending exactly where the strategy needs it.

Why: every call of Keras' train function costs a fixed Python and TensorFlow dispatch, plus Keras' callbacks
around it: for a small model most of a step. Keras' ``steps_per_execution`` alone cannot serve a worker:
its pipelines repeat (datasets.py), and Keras ends a call only after N steps or when the data ends, so a
call would run into the next epoch's batches. So under parameter averaging Keras drives its loop with
``steps_per_execution = B`` while the model's train and test functions (``block_function``) run ``min(B,
steps left in the pass)`` steps, set before each call from its first batch (``StepBlocks``). Invariant: B
divides the averaging frequency (``block_size``), so every round follows exactly the batch it followed with
one step per call: the same steps, the same rounds, the same numbers.
"""
from __future__ import annotations

from collections.abc import Callable, Sized
from typing import Any

import keras

MAX_BLOCK = 16  # steps per call at most: progress events and phase reports stay per few steps


def block_size(every: int, steps: int, cap: int = MAX_BLOCK) -> int:
    """Steps per call for a worker averaging after every ``every`` of its ``steps`` batches per epoch.

    Rounds follow batches ``every - 1, 2 * every - 1, ...`` and the epoch's last batch, so calls of B
    steps from batch 0 end at every round when B divides ``every``, or whatever B is when ``every``
    reaches past the epoch (then only the last batch has a round, and every pass ends a call).
    """
    if every < 1 or steps < 1:
        raise ValueError(f"averaging frequency and steps must be >= 1, got {every} and {steps}")
    limit = max(1, min(cap, steps))
    if every >= steps:
        return limit
    return max(d for d in range(1, min(limit, every) + 1) if every % d == 0)


def steps_in_call(first_batch: int, block: int, steps: int) -> int:
    """Steps the call starting at ``first_batch`` runs: a full block, or what is left of the pass."""
    return max(1, min(block, steps - first_batch))


def block_function(model: Any, step: Callable[[Any], Any], count: Callable[[], int],
                   after_step: Callable[[], Any] | None = None) -> Callable[[Any], Any]:
    """A train or test function for Keras' loop that runs ``count()`` steps of ``step`` per call.

    Like Keras' own: each step runs under the model's distribution strategy in one compiled function
    (XLA when the model asks for it), and the call returns the last step's logs. ``after_step``: an
    op run after each step (the allreduce schedule's step counter).
    """
    import tensorflow as tf

    def one_step(data: Any) -> Any:
        return model.distribute_strategy.run(step, args=(data,))

    one_step = tf.function(one_step, reduce_retracing=True, jit_compile=bool(model.jit_compile))

    def stepped(data: Any) -> Any:
        logs = one_step(data)
        if after_step is not None:
            after_step()  # ordered after the step: stateful ops run in program order in a tf.function
        return logs

    @tf.function(reduce_retracing=True)
    def steps(iterator: Any, n: Any) -> Any:
        def body(i: Any) -> tuple[Any]:
            stepped(iterator.get_next())  # its variable updates run: stateful ops are kept in order
            return (i + 1,)

        tf.while_loop(lambda i: i < n - 1, body, (tf.constant(0),))
        return stepped(iterator.get_next())

    def function(iterator: Any) -> Any:
        return steps(iterator, tf.constant(count(), dtype=tf.int32))

    return function


class StepBlocks(keras.callbacks.Callback):
    """Tells the block functions, before each call, how many steps to run (``install`` puts them on the model).

    Keras calls batch-begin hooks before each call with the call's first batch, train and test alike.
    """

    def __init__(self, block: int, train_steps: int, val_steps: int | None,
                 after_train_step: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.block, self.train_steps, self.val_steps = block, train_steps, val_steps or 1
        self.after_train_step = after_train_step
        self._train_n = self._test_n = 1

    def install(self, model: Any) -> StepBlocks:
        """Make ``model.fit`` call B steps at a time through the block functions."""
        model.steps_per_execution = self.block
        model.train_function = block_function(model, model.train_step, lambda: self._train_n,
                                              self.after_train_step)
        model.test_function = block_function(model, model.test_step, lambda: self._test_n)
        return self

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._train_n = steps_in_call(batch, self.block, self.train_steps)

    def on_test_batch_begin(self, batch: int, logs: Any = None) -> None:
        self._test_n = steps_in_call(batch, self.block, self.val_steps)


class BatchSpan:
    """The batches a call covered: from the one after the last call's end to its end, clipped to the pass.

    ``batches``: the pass's batches (anything with a length, read at each call: a PyDataset's share
    knows its count only once the epoch starts).
    """

    def __init__(self, batches: Sized) -> None:
        self.batches = batches
        self.next = 0

    def reset(self) -> None:
        self.next = 0

    def advance(self, last: int) -> range:
        """The batches up to ``last`` (the call's reported end) not counted yet."""
        end = min(last, len(self.batches) - 1) + 1
        done, self.next = range(self.next, end), max(self.next, end)
        return done
