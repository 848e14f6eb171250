"""A framework's tensors as the arrays they travel as (model/graph.py pickles the model with these).

Only arrays cross the wire: a torch tensor pickled as torch does carries its device, and a worker without
that device (a CPU executor, a container without --gpus) cannot load it ("Attempting to deserialize object
on a CUDA device"). So it travels as a numpy array and is made again on the receiving process's device.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np


def tensor_from_array(value: np.ndarray, dtype: str, parameter: bool, requires_grad: bool) -> Any:
    """A torch tensor from the array it travelled as, on this process's device (Keras' torch device where
    Keras runs on torch: the worker's GPU, or the CPU where it has none)."""
    import torch

    tensor = torch.from_numpy(np.array(value)).to(device=_device(), dtype=getattr(torch, dtype))
    return torch.nn.Parameter(tensor, requires_grad=requires_grad) if parameter else tensor


def empty_tensor(shape: tuple[int, ...], dtype: str, parameter: bool, requires_grad: bool) -> Any:
    """A zero torch tensor of the shape a tensor whose value travels apart had (assigned on arrival)."""
    import torch

    tensor = torch.zeros(shape, device=_device(), dtype=getattr(torch, dtype))
    return torch.nn.Parameter(tensor, requires_grad=requires_grad) if parameter else tensor


def tensor_layout(obj: Any) -> tuple[tuple[int, ...], str, bool, bool]:
    """What ``empty_tensor`` remakes a torch tensor from: its shape, dtype and kind, not its value."""
    import torch

    return (tuple(obj.shape), str(obj.dtype).removeprefix("torch."), isinstance(obj, torch.nn.Parameter),
            bool(obj.requires_grad))


def _device() -> Any:
    """Keras' torch device where Keras runs on torch (the worker's GPU, or the CPU where it has none)."""
    if sys.modules.get("keras") is not None:
        import keras

        if keras.backend.backend() == "torch":
            from keras.src.backend.torch.core import get_device

            return get_device()
    return "cpu"


def tensor_as_array(obj: Any) -> tuple[np.ndarray, str, bool, bool]:
    """A torch tensor as an array (bfloat16, which numpy lacks, as float32) and what remakes it."""
    import torch

    data = obj.detach()
    wide = data.float() if data.dtype == torch.bfloat16 else data
    return (wide.cpu().numpy(), str(data.dtype).removeprefix("torch."), isinstance(obj, torch.nn.Parameter),
            bool(obj.requires_grad))


def without_torch_params(state: dict[str, Any]) -> dict[str, Any]:
    """A Keras torch layer's state without ``_torch_params``: the torch module that holds the layer's
    variables' tensors a second time (remade from the variables when next needed, as Keras does)."""
    modules = state.get("_modules")
    if isinstance(modules, dict) and "_torch_params" in modules:
        state["_modules"] = type(modules)((k, v) for k, v in modules.items() if k != "_torch_params")
    return state


def keras_data(struct: Any) -> Any:
    """Data as Keras takes it: ragged rows (``data.ragged.RaggedRows``, a tf.RaggedTensor's numpy components)
    as the ``tf.RaggedTensor`` they came from, in dicts, lists and tuples as they are; anything else as it is."""
    from ..data.ragged import RaggedRows

    if isinstance(struct, RaggedRows):
        import tensorflow as tf

        return tf.RaggedTensor.from_nested_row_splits(struct.values, list(struct.splits), validate=False)
    if isinstance(struct, dict):
        return {k: keras_data(v) for k, v in struct.items()}
    if isinstance(struct, list):
        return [keras_data(v) for v in struct]
    if isinstance(struct, tuple):
        items = [keras_data(v) for v in struct]
        return type(struct)(*items) if hasattr(struct, "_fields") else tuple(items)
    return struct


def module_buffers(model: Any) -> list[Any]:
    """The tensors the torch modules inside a Keras model (``keras.layers.TorchModuleWrapper``) keep beside
    their parameters, such as BatchNorm's running statistics: Keras tracks no variable for them, so they are
    carried apart (trained state, epoch averages). In the order of the model's layers, then each module's
    ``named_buffers``; [] where Keras does not run on torch."""
    if "torch" not in sys.modules or sys.modules.get("keras") is None:
        return []
    import keras

    if keras.backend.backend() != "torch":
        return []
    seen: set[int] = set()
    out = []
    for layer in model._flatten_layers(include_self=True):
        module = getattr(layer, "module", None) if type(layer).__name__ == "TorchModuleWrapper" else None
        for _, tensor in (module.named_buffers() if module is not None else ()):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                out.append(tensor)
    return out


def buffer_arrays(model: Any) -> list[np.ndarray]:
    """The model's module buffers (``module_buffers``) as numpy copies: a CPU tensor's ``numpy()`` shares its
    memory, and the next step would change what is still to be sent."""
    return [np.array(tensor_as_array(t)[0]) for t in module_buffers(model)]


class BufferVariable:
    """A module buffer (``module_buffers``) as averaging reads and writes a variable: shape, dtype,
    ``numpy()`` and ``assign()``, written in place so that the module keeps the same tensor."""

    def __init__(self, tensor: Any) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)
        self.dtype = str(tensor.dtype).removeprefix("torch.")

    @property
    def value(self) -> Any:
        """The tensor itself, as a Keras torch variable's ``value`` (the device averager writes into it)."""
        return self.tensor

    def numpy(self) -> np.ndarray:
        return tensor_as_array(self.tensor)[0]

    def assign(self, value: Any) -> None:
        import torch

        with torch.no_grad():
            self.tensor.copy_(torch.as_tensor(np.asarray(value)).reshape(self.shape))


def buffer_variables(model: Any) -> list[BufferVariable]:
    """The model's module buffers (``module_buffers``) as variables to read and assign."""
    return [BufferVariable(t) for t in module_buffers(model)]


def float_buffers(model: Any) -> list[BufferVariable]:
    """The model's floating-point module buffers as variables to average."""
    return [v for v in buffer_variables(model) if v.tensor.is_floating_point()]
