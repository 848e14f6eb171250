"""The torch backend's NCCL path (``TorchNcclSum``, strategies/backend_grads.py), run once on this machine.

There is no GPU here, so NCCL cannot run: the CPU and a one-rank Gloo group stand in for the GPU and NCCL
(the only stand-in). What runs is the code around the collective: each gradient weighted by the worker's
rows into one flat buffer, None gradients kept None, shapes and dtypes handed back, the summed rows checked
against the step's total, a pad step's zeros. One rank's sum is the identity, so the weighting shows only
as a step whose rows are not its total being refused.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist

from nbdist.strategies.backend_grads import HostGradientAllreduce, TorchNcclSum
from nbdist.strategies.collective import SoloCollective

SHAPES = [(2, 3), (3,), (4,)]


@pytest.fixture
def stand_in() -> Iterator[tuple[TorchNcclSum, HostGradientAllreduce]]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        owner = HostGradientAllreduce(SoloCollective(), [np.zeros(s, np.float32) for s in SHAPES])
        yield TorchNcclSum(device="cpu", backend="gloo"), owner  # the CPU and Gloo stand in for the GPU and NCCL
    finally:
        dist.destroy_process_group()


def test_the_step_comes_back_as_it_went_and_a_disagreeing_total_is_refused(stand_in):
    nccl, owner = stand_in
    grads = [torch.arange(6, dtype=torch.float32).reshape(2, 3), None, torch.full((4,), 0.5, dtype=torch.float16)]
    owner.set_weight(64, 64)
    owner._take_weight()
    out = nccl.reduce(owner, grads)
    assert out[1] is None and out[0].shape == (2, 3) and out[2].dtype == torch.float16
    np.testing.assert_array_equal(out[0].numpy(), grads[0].numpy())
    np.testing.assert_array_equal(out[2].numpy(), grads[2].numpy())
    assert owner.steps == 1

    owner.set_weight(32, 64)  # 32 rows of a step of 64: with no peer adding the other 32, the check fails
    owner._take_weight()
    with pytest.raises(RuntimeError, match="workers disagree on this step's samples: 32 summed, 64 expected"):
        nccl.reduce(owner, grads)


def test_a_pad_step_sends_zeros_where_gradients_come(stand_in):
    nccl, _ = stand_in
    zeros = nccl.zeros(SHAPES, [True, False, True])
    assert zeros[1] is None and [tuple(z.shape) for z in (zeros[0], zeros[2])] == [SHAPES[0], SHAPES[2]]
    assert all(float(z.abs().sum()) == 0.0 for z in (zeros[0], zeros[2]))
