"""Keras' Adam and SGD updates as TensorFlow's fused kernels, on the workers (TensorFlow backend only).

Keras writes an update as about ten passes over the parameters; the fused kernel computes the same formula
in one (``ResourceApplyAdam``, ``ResourceApplyKerasMomentum``, ``ResourceApplyGradientDescent``), equal to float32
rounding. Used only where the optimizer's own ``update_step`` is Keras', on dense float gradients, and by
default only for models of ``FUSED_MIN_PARAMETERS`` or more dense-gradient parameters (smaller ones keep
Keras' operations and a one-worker run equal to a local fit to the last bit).
"""
from __future__ import annotations

import logging
import types
from typing import Any

import numpy as np

log = logging.getLogger("nbdist.worker")

# Trainable parameters from which the fused kernels are used by default (TrainConfig.fused_updates).
FUSED_MIN_PARAMETERS = 1 << 20


def fused_kind(optimizer: Any) -> str | None:
    """"adam" or "sgd" when ``optimizer``'s update can run as a fused kernel, else None."""
    import keras

    cls = type(optimizer)
    if isinstance(optimizer, keras.optimizers.Adam) and cls.update_step is keras.optimizers.Adam.update_step:
        return None if optimizer.amsgrad else "adam"
    if isinstance(optimizer, keras.optimizers.SGD) and cls.update_step is keras.optimizers.SGD.update_step:
        return "sgd"
    return None


def install_fused_updates(model: Any, min_parameters: int = 0) -> list[str]:
    """Replace the update step of every optimizer in ``model`` that has a fused kernel; returns their kinds.

    Only on TensorFlow and for models of at least ``min_parameters`` trainable parameters; a
    LossScaleOptimizer's inner optimizer is the one that updates.

    The same step: ``ResourceApplyAdam`` computes exactly Keras' Adam (``alpha = lr * sqrt(1 - b2^t) /
    (1 - b1^t)``, ``m += (g - m)(1 - b1)``, ``v += (g^2 - v)(1 - b2)``, ``var -= m alpha / (sqrt(v) + eps)``,
    the same operations in the same order), ``ResourceApplyKerasMomentum`` Keras' SGD with momentum
    (Nesterov too), ``ResourceApplyGradientDescent`` plain SGD; results agree to float32 rounding
    (the kernels may fuse a multiply and an add). Everything around the update stays Keras':
    gradient clipping, weight decay (AdamW), learning-rate schedules, EMA, loss scaling, the step
    counter. Used only where the class's own ``update_step`` is Keras' (a subclass that overrides it
    keeps its own), without AMSGrad, on dense float gradients (an ``IndexedSlices`` keeps Keras' path).
    """
    import keras

    if keras.backend.backend() != "tensorflow" or getattr(model, "optimizer", None) is None:
        return []
    if sum(int(np.prod(v.shape)) for v in model.trainable_variables) < min_parameters:
        return []
    installed = []
    for optimizer in _updating_optimizers(model.optimizer):
        kind = fused_kind(optimizer)
        if kind is not None:
            keras_step = optimizer.update_step
            step = _adam_step if kind == "adam" else _sgd_step
            optimizer.update_step = types.MethodType(_dense_only(step, keras_step), optimizer)
            if min_parameters > 0:
                _count_dense_gradients(optimizer, min_parameters)
            installed.append(kind)
    if installed:
        log.info("optimizer updates run as fused kernels: %s", ", ".join(installed))
    return installed


def _updating_optimizers(optimizer: Any) -> list[Any]:
    inner = getattr(optimizer, "inner_optimizer", None)  # LossScaleOptimizer
    return [inner] if inner is not None else [optimizer]


def _count_dense_gradients(optimizer: Any, min_parameters: int) -> None:
    """Fuse only while the step's dense gradients cover ``min_parameters`` (decided as ``apply`` is traced)."""
    original = optimizer.apply

    def apply(grads: Any, trainable_variables: Any = None) -> Any:
        import tensorflow as tf

        grads = list(grads)
        variables = optimizer._trainable_variables if trainable_variables is None else trainable_variables
        dense = sum(int(np.prod(v.shape)) for g, v in zip(grads, variables)
                    if g is not None and not isinstance(g, tf.IndexedSlices))
        optimizer._nbdist_fuse = dense >= min_parameters
        return original(grads, trainable_variables)

    optimizer.apply = apply  # an instance attribute: apply_gradients looks it up on self


def _dense_only(fused: Any, keras_step: Any) -> Any:
    def update_step(self: Any, gradient: Any, variable: Any, learning_rate: Any) -> Any:
        import tensorflow as tf

        if (isinstance(gradient, tf.IndexedSlices) or not tf.as_dtype(variable.dtype).is_floating
                or not getattr(self, "_nbdist_fuse", True)):
            return keras_step(gradient, variable, learning_rate)
        return fused(self, gradient, variable, learning_rate)

    return update_step


def _handle(variable: Any) -> Any:
    import keras

    if isinstance(variable, keras.Variable):  # a Keras variable wraps a tf.Variable
        variable = variable.value
    return variable.handle


def _adam_step(self: Any, gradient: Any, variable: Any, learning_rate: Any) -> Any:
    import tensorflow as tf

    dtype = variable.dtype
    step = tf.cast(self.iterations + 1, dtype)
    beta_1, beta_2 = tf.cast(self.beta_1, dtype), tf.cast(self.beta_2, dtype)
    index = self._get_variable_index(variable)
    return tf.raw_ops.ResourceApplyAdam(
        var=_handle(variable), m=_handle(self._momentums[index]), v=_handle(self._velocities[index]),
        beta1_power=tf.pow(beta_1, step), beta2_power=tf.pow(beta_2, step), lr=tf.cast(learning_rate, dtype),
        beta1=beta_1, beta2=beta_2, epsilon=tf.cast(self.epsilon, dtype), grad=tf.cast(gradient, dtype),
        use_locking=False)


def _sgd_step(self: Any, gradient: Any, variable: Any, learning_rate: Any) -> Any:
    import tensorflow as tf

    dtype = variable.dtype
    lr, grad = tf.cast(learning_rate, dtype), tf.cast(gradient, dtype)
    if self.momentum == 0:
        return tf.raw_ops.ResourceApplyGradientDescent(var=_handle(variable), alpha=lr, delta=grad,
                                                       use_locking=False)
    accum = self.momentums[self._get_variable_index(variable)]
    return tf.raw_ops.ResourceApplyKerasMomentum(
        var=_handle(variable), accum=_handle(accum), lr=lr, grad=grad, momentum=tf.cast(self.momentum, dtype),
        use_locking=False, use_nesterov=bool(self.nesterov))
