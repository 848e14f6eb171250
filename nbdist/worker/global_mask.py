"""A masked loss normalised by the global batch's valid entries, as one local step would normalise it.

Keras normalises a masked loss (``mask_zero``, ``Masking``, a padded sequence) by the valid entries of the
batch it sees (``keras.src.losses.loss.apply_mask``: each valid entry weighted ``total / valid``). A
worker sees only its share, so its loss ``S_w / V_w`` scaled by rows (n_w / N) would not add up to the local
``sum S_w / sum V_w`` when shares hold different numbers of valid entries. Here the weight is ``total /
valid`` of the GLOBAL batch (both summed over the workers inside the train step, one tiny sum per masked
loss, on each of Keras' three backends: ``global_weight``), so weighted by n_w / N the shares add up to the
local step's ``S / V``. Only training steps change (validation keeps Keras' per-batch normalisation);
unmasked losses and the ``sum``/``none`` reductions are untouched.
"""
from __future__ import annotations

import logging
from typing import Any

import numpy as np

log = logging.getLogger("nbdist.worker")


_active: GlobalMaskNormaliser | None = None  # this process's current job's (a warm worker runs several)


def _patch_keras_once() -> None:
    """Route Keras' ``apply_mask`` through the active normaliser; patched once per process, so jobs
    run one after another in a warm worker do not stack wrappers."""
    import keras.src.losses.loss as loss_module

    if getattr(loss_module.apply_mask, "nbdist_original", None) is not None:
        return
    original = loss_module.apply_mask

    def apply_mask(sample_weight: Any, mask: Any, dtype: Any, reduction: Any) -> Any:
        normaliser = _active
        if (normaliser is None or mask is None or not normaliser.tracing
                or reduction not in ("mean", "sum_over_batch_size")):
            return original(sample_weight, mask, dtype, reduction)
        weights = original(sample_weight, mask, dtype, "sum")  # sample weight x 0/1 mask
        return weights * normaliser.global_weight(mask, dtype)

    apply_mask.nbdist_original = original  # type: ignore[attr-defined]
    loss_module.apply_mask = apply_mask


class GlobalMaskNormaliser:
    """Installs the global normalisation of masked losses on this worker's train step."""

    def __init__(self, collective: Any) -> None:
        self.collective = collective
        self.calls_per_step = 0  # masked losses in one train step (found when it is traced)
        self.tracing = False  # set while this job's train step is traced (or run eagerly)
        self._calls = 0
        self._last: Any = None  # the previous sum in this trace: the sums run in the same order everywhere
        self._torch_weight: Any = None  # torch: ``_eager_weight`` kept out of torch.compile, made once

    def install(self, model: Any) -> None:
        global _active
        _patch_keras_once()
        _active = self
        original_step = model.train_step

        # Any signature: TensorFlow's and torch's ``train_step(data)``, JAX's stateless ``train_step(state, data)``.
        def train_step(*args: Any, **kwargs: Any) -> Any:
            self.tracing, self._calls, self._last = True, 0, None
            try:
                return original_step(*args, **kwargs)
            finally:
                self.tracing = False
                self.calls_per_step = self._calls

        model.train_step = train_step  # an instance attribute: Keras' train function calls self.train_step

    def global_weight(self, mask: Any, dtype: Any) -> Any:
        """``total / valid`` of the global batch (0 where nothing is valid), a tensor of ``dtype``.

        Each backend sums the counts where its step runs: TensorFlow in a graph op, JAX in an ordered host
        call inside the jitted step (ordered with the gradients' own, so every worker runs the same sums in
        the same order), torch eagerly (also inside ``torch.compile``)."""
        import keras

        self._calls += 1
        backend = keras.backend.backend()
        if backend == "tensorflow":
            return self._tensorflow_weight(mask, dtype)
        if backend == "jax":
            return self._jax_weight(mask, dtype)
        if self._torch_weight is None:  # eagerly under jit_compile=True too (a graph break): it cannot be traced
            import torch

            self._torch_weight = torch.compiler.disable(self._eager_weight)
        return self._torch_weight(mask, dtype)

    def _tensorflow_weight(self, mask: Any, dtype: Any) -> Any:
        import tensorflow as tf

        local = tf.stack([tf.reduce_sum(tf.cast(mask, tf.float64)), tf.cast(tf.size(mask), tf.float64)])
        deps = [] if self._last is None else [self._last]
        with tf.control_dependencies(deps):
            summed = tf.numpy_function(self.sum_counts, [local], Tout=tf.float64, stateful=True,
                                       name="nbdist_global_mask_counts")
        summed.set_shape([2])
        self._last = summed
        valid, total = summed[0], summed[1]
        return tf.cast(tf.math.divide_no_nan(total, valid), dtype)

    def _jax_weight(self, mask: Any, dtype: Any) -> Any:
        import jax
        import jax.numpy as jnp
        from jax.experimental import io_callback

        # Counts, not a function of the weights: no gradient flows into the host call. float32 counts
        # are exact up to 2**24 entries per global batch (JAX has no float64 unless x64 is enabled).
        ones = jax.lax.stop_gradient(jnp.asarray(mask).astype(jnp.float32))
        local = jnp.stack([jnp.sum(ones), jnp.float32(ones.size)])
        summed = io_callback(lambda counts: self.sum_counts(counts).astype(np.float32),
                             jax.ShapeDtypeStruct((2,), jnp.float32), local, ordered=True)
        return self._divide(summed[0], summed[1], dtype)

    def _eager_weight(self, mask: Any, dtype: Any) -> Any:
        import keras

        ones = keras.ops.cast(mask, "float32")
        local = np.array([float(keras.ops.convert_to_numpy(keras.ops.sum(ones))), float(np.prod(ones.shape))])
        valid, total = self.sum_counts(local)
        return self._divide(keras.ops.convert_to_tensor(np.float32(valid)),
                            keras.ops.convert_to_tensor(np.float32(total)), dtype)

    @staticmethod
    def _divide(valid: Any, total: Any, dtype: Any) -> Any:
        """As Keras' ``apply_mask`` divides (in ``dtype``), so one worker equals the local step bit for bit."""
        import keras

        return keras.ops.divide_no_nan(keras.ops.cast(total, dtype), keras.ops.cast(valid, dtype))

    def sum_counts(self, local: np.ndarray) -> np.ndarray:
        counts = np.array(local, dtype=np.float64)
        self.collective.allreduce_sum(counts)
        return counts

    def pad(self) -> None:
        """A step with no rows of ours (a shorter share's missing batch): join the step's sums with zeros."""
        for _ in range(self.calls_per_step):
            self.sum_counts(np.zeros(2))
