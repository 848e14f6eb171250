"""Issue 36: the job message carries arrays, never a framework's tensors. A torch tensor pickled with the model
travels with its device (a model built on a GPU failed on CPU workers: "Attempting to deserialize object on a
CUDA device"); now it travels as a numpy array and is made again on the receiving process's device.

Here on TensorFlow's backend, a layer holding torch tensors stands in for Keras' torch layers (whose
``_torch_params`` hold the variables' tensors a second time: tests/workers/test_backends.py checks those on
the torch backend). No GPU here: the tensors are CPU ones, and what is checked is that no torch tensor, storage
or device is in the pickle at all.
"""
from __future__ import annotations

import pickletools

import keras
import numpy as np
import torch

from nbdist.model.spec import model_from_spec, travelling_model


class HoldsTorch(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.table = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        self.half = torch.full((2,), 1.5, dtype=torch.bfloat16)
        self.param = torch.nn.Parameter(torch.ones(3), requires_grad=False)

    def call(self, x):
        return x


def torch_names(data: bytes) -> list[str]:
    """The torch module and class names a pickle refers to (a tensor pickled as torch does refers to
    torch._utils._rebuild_tensor_v2 and torch.storage)."""
    return [arg for op, arg, _ in pickletools.genops(data)
            if isinstance(arg, str) and (arg.startswith("torch") or "rebuild_" in arg or "Storage" in arg)]


def test_torch_tensors_in_a_model_travel_as_arrays_and_come_back_as_tensors():
    model = keras.Sequential([keras.Input((3,)), HoldsTorch(), keras.layers.Dense(2)])
    model.compile("adam", "mse")
    spec = travelling_model(model)
    assert torch_names(spec.graph) == []
    assert all(isinstance(w, np.ndarray) for w in spec.weights + (spec.optimizer_weights or []))
    layer = model_from_spec(spec).layers[0]
    assert isinstance(layer.table, torch.Tensor) and layer.table.device.type == "cpu"
    np.testing.assert_array_equal(layer.table.numpy(), np.arange(6, dtype=np.float32).reshape(2, 3))
    assert layer.half.dtype == torch.bfloat16 and float(layer.half[0]) == 1.5
    assert isinstance(layer.param, torch.nn.Parameter) and not layer.param.requires_grad
