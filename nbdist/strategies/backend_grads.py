"""The gradient allreduce on Keras' JAX and torch backends: their optimizers wrapped so that gradients are
summed between the backward pass and the update.

torch: the wrapped ``optimizer.apply`` sums ``.grad`` (host buckets, or torch's device buckets); JAX: the
wrapped ``stateless_apply`` sums through an ordered ``io_callback`` inside the jitted step (or, ``--engine
jax``, jax_device_sum.py). Invariant: each step's (rows, total rows) is queued by ``set_weight`` and taken by
that step's own exchange, in order, however late JAX runs it.
"""
from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from .allreduce_hook import GradientAllreduce
from .averaging import synced_state

__all__ = ["HostGradientAllreduce", "SelfDistributionGuard", "synced_state",
           "wrap_jax_optimizer", "wrap_torch_optimizer"]


class SelfDistributionGuard(keras.callbacks.Callback):
    """``refuse_self_distribution`` once Keras has made its train function, before the first step."""

    def on_train_begin(self, logs: Any = None) -> None:
        refuse_self_distribution(self.model)


def refuse_self_distribution(model: Any) -> None:
    """Keras' torch trainer on its main branch (3.16.dev) wraps the model in DistributedDataParallel and
    all-reduces metric variables whenever a torch process group exists, and nbdist's Gloo group is one: its
    gradients would be synchronised twice and its metrics summed twice. The released Keras (<= 3.15) does
    neither. Checked where Keras would act: the train function it makes, and the model it trains."""
    try:
        from torch.nn.parallel import DistributedDataParallel
    except ImportError:  # no torch: no such trainer
        return
    if isinstance(model, DistributedDataParallel) or any(
            isinstance(v, DistributedDataParallel) for v in vars(model).values()):
        from ..errors import NbdistError

        raise NbdistError(f"Keras {keras.__version__} distributes a torch model by itself when a process group "
                          "exists, which would synchronise it twice under nbdist; use Keras 3.15 or earlier on "
                          "the torch backend.")


class HostGradientAllreduce(GradientAllreduce):
    """``GradientAllreduce`` for Keras' torch and JAX backends (see the module's docstring).

    torch: Keras' ``train_step`` calls ``loss.backward()``, reads each variable's ``.grad`` and calls
    ``optimizer.apply(grads, variables)``; the wrapped ``apply`` sums them in between (``reduce_torch``), on the
    device where the plan says (device_sum.py), in buckets that may start during the backward pass
    (torch_overlap.py). JAX: an ordered ``io_callback`` inside the jitted step (``reduce_arrays``), reusing
    nbdist's exchange, its timeouts and health checks. Callbacks that read or write variables in the middle of a
    JAX fit (averaging, metric sums, pad steps) call ``synced_state`` first: Keras' JAX trainer keeps the state
    outside the variables between steps.
    """

    def __init__(self, collective: Any, variables: Sequence[Any], *args: Any, **kwargs: Any) -> None:
        self._variables = list(variables)
        super().__init__(collective, variables, *args, loss_scaling=False, **kwargs)
        self.prescaled = False  # scaled by rows while copied into the bucket (``exchange``)
        self._queued: collections.deque[tuple[float, float | None]] = collections.deque()
        self._overlap: Any = None  # torch_overlap.TorchOverlap: the device sum's buckets started during backward
        self.overlapped = False  # whether any step's buckets started during its backward pass

    @property
    def summed_by(self) -> str | None:
        """"device-overlapped" where torch's buckets started during a backward pass (torch_overlap.py)."""
        return "device-overlapped" if self.overlapped else super().summed_by

    def overlap_backward(self, model: Any) -> str | None:
        """The device sum's buckets started during the backward pass, by hooks on the variables' torch tensors
        (torch_overlap.py), where that is sound; otherwise the reason, and the buckets start at ``apply``."""
        from .torch_overlap import TorchOverlap, overlap_refusal

        if self._engine_impl is None:
            return "no device sum"
        if not self.plan.overlap:
            return "overlap=False"
        tensors = [v.value for v in self._variables]
        reason = overlap_refusal(model, tensors, len(self._engine_impl.plan))
        if reason is None:
            self._overlap = TorchOverlap(self._engine_impl, tensors, self)
        return reason

    def close(self) -> None:
        """The run's end: no hook stays on the model's tensors, no thread of the sum runs."""
        super().close()
        overlap, self._overlap = self._overlap, None
        if overlap is not None:
            self.overlapped = self.overlapped or overlap.early_launches > 0
            overlap.close()

    def set_weight(self, samples: float, total: float | None = None) -> None:
        self._queued.append((float(samples), None if total is None else float(total)))

    def _take_weight(self) -> None:
        """This step's (rows, total rows), queued by ``set_weight`` (JAX may run a step's host call late)."""
        if not self._queued:
            raise RuntimeError("an allreduce step ran without its rows set (set_weight)")
        self.weight, self.total = self._queued.popleft()

    def reduce_arrays(self, grads: Sequence[np.ndarray | None]) -> list[np.ndarray | None]:
        """The step's gradients summed over the workers, each weighted by its rows (None stays None)."""
        self._take_weight()
        self._check_present(list(grads))
        dense = [np.zeros(s, self.dtype) if g is None else np.asarray(g, dtype=self.dtype)
                 for g, s in zip(grads, self.shapes)]
        out = self.exchange(*dense)
        return [None if g is None else o for g, o in zip(grads, out)]

    def reduce_torch(self, grads: Sequence[Any]) -> list[Any]:
        """torch's gradients summed, each weighted by its worker's rows: on the GPU over NCCL, else through the
        numpy exchange (a copy to the host and back; none on a CPU, where the tensor shares the array)."""
        import torch

        if self._engine_impl is not None:
            self._take_weight()
            self._check_present(list(grads))
            if self._overlap is not None:
                out = self._overlap.reduce(self, list(grads))
                self.overlapped = self.overlapped or self._overlap.early_launches > 0
                return out
            return self._engine_impl.reduce(self, list(grads))
        flat = torch.float64 if self.dtype == np.float64 else torch.float32  # the host bucket's
        arrays = [None if g is None else g.detach().to("cpu", flat).numpy() for g in grads]
        summed = self.reduce_arrays(arrays)
        return [None if g is None else torch.from_numpy(s).to(device=g.device, dtype=g.dtype)
                for g, s in zip(grads, summed)]

    def _pad_sum(self, present: Sequence[bool]) -> list[Any]:
        """A pad step's summed gradients: the device sum's zeros made on its device, else numpy's exchanged."""
        if self._engine_impl is not None:
            return self.reduce_torch(self._engine_impl.zeros(self.shapes, present))
        summed = self.reduce_arrays([np.zeros(s, self.dtype) if p else None for s, p in zip(self.shapes, present)])
        return [None if g is None else keras.ops.convert_to_tensor(np.array(g)) for g in summed]


def wrap_torch_optimizer(optimizer: Any, reducer: HostGradientAllreduce) -> Callable[..., Any]:
    """Make ``optimizer.apply`` sum the gradients first (between ``backward`` and the update); return the original.
    Under ``jit_compile=True`` (``torch.compile`` of the train step) the sum runs eagerly, a graph break: traced,
    its numpy and collectives would be compiled into the graph or fail."""
    import torch

    original = optimizer.apply
    reduce = torch.compiler.disable(reducer.reduce_torch)

    def apply(grads: Sequence[Any], trainable_variables: Any = None) -> Any:
        return original(reduce(grads), trainable_variables)

    optimizer.apply = apply  # an instance attribute: Keras' train step and apply_gradients look it up on self
    return original


def wrap_jax_optimizer(optimizer: Any, reducer: HostGradientAllreduce) -> Callable[..., Any]:
    """Make ``optimizer.stateless_apply`` sum the gradients first, through a host call inside the jitted step;
    return the original stateful ``apply`` (for pad steps, run between steps on the synced variables)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    original = optimizer.stateless_apply

    def host(*arrays: Any) -> list[np.ndarray]:
        summed = reducer.reduce_arrays([np.asarray(a) for a in arrays])
        # copies, each in its gradient's dtype as declared: the bucket is reused next step
        return [np.array(s, dtype=a.dtype) for s, a in zip(summed, arrays)]

    def stateless_apply(optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
        grads = list(grads)
        # float64 gradients (JAX with x64 on) stay float64; anything else is summed as float32
        dense = [jnp.asarray(g, jnp.float64 if g.dtype == jnp.float64 else jnp.float32) for g in grads]
        shapes = [jax.ShapeDtypeStruct(g.shape, g.dtype) for g in dense]
        summed = io_callback(host, shapes, *dense, ordered=True)
        grads = [s.astype(g.dtype) for g, s in zip(grads, summed)]
        return original(optimizer_variables, grads, trainable_variables)

    optimizer.stateless_apply = stateless_apply
    return optimizer.apply
