"""The torch backend's device sum (``TorchDeviceSum``, strategies/device_sum.py): NCCL on CUDA, Gloo on CPU.

The code is the same for both; on this machine (no GPU) a one-rank Gloo group on CPU tensors runs it: each
gradient weighted by the worker's rows into few flat buckets, None gradients kept None, shapes and dtypes
handed back, the summed rows checked against the step's total, a pad step's zeros. One rank's sum is the
identity, so the weighting shows only as a step whose rows are not its total being refused. Where CUDA is
present, the same runs on a one-rank NCCL group (all one GPU allows); elsewhere that test skips, saying why.
The two-worker sum itself runs in tests/workers/test_backends.py (torch, Gloo on torch tensors).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist

from nbdist.strategies.backend_grads import HostGradientAllreduce
from nbdist.strategies.collective import SoloCollective
from nbdist.strategies.device_sum import TorchDeviceSum, bucket_plan

SHAPES = [(2, 3), (3,), (4,)]


@pytest.fixture
def one_rank() -> Iterator[HostGradientAllreduce]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield HostGradientAllreduce(SoloCollective(), [np.zeros(s, np.float32) for s in SHAPES])
    finally:
        dist.destroy_process_group()


def test_buckets_are_consecutive_and_at_most_the_limit_unless_one_gradient_is_larger():
    assert bucket_plan([6, 3, 4], 10) == [[0, 1], [2]]
    assert bucket_plan([6, 3, 4], 100) == [[0, 1, 2]]
    assert bucket_plan([50, 3, 4], 10) == [[0], [1, 2]]
    assert bucket_plan([], 10) == []


@pytest.mark.parametrize("bucket_bytes", [4 * 6, 2**20])  # three buckets of a step, or one
def test_the_step_comes_back_as_it_went_and_a_disagreeing_total_is_refused(one_rank, bucket_bytes):
    owner = one_rank
    summer = TorchDeviceSum(SHAPES, "cpu", bucket_bytes=bucket_bytes)
    assert len(summer.buckets) == (3 if bucket_bytes == 24 else 1)
    grads = [torch.arange(6, dtype=torch.float32).reshape(2, 3), None, torch.full((4,), 0.5, dtype=torch.float16)]
    owner.set_weight(64, 64)
    owner._take_weight()
    out = summer.reduce(owner, grads)
    assert out[1] is None and out[0].shape == (2, 3) and out[2].dtype == torch.float16
    np.testing.assert_array_equal(out[0].numpy(), grads[0].numpy())
    np.testing.assert_array_equal(out[2].numpy(), grads[2].numpy())
    assert owner.steps == 1

    owner.set_weight(32, 64)  # 32 rows of a step of 64: with no peer adding the other 32, the check fails
    owner._take_weight()
    with pytest.raises(RuntimeError, match="workers disagree on this step's samples: 32 summed, 64 expected"):
        summer.reduce(owner, grads)


def test_a_pad_step_sends_zeros_where_gradients_come(one_rank):
    zeros = TorchDeviceSum(SHAPES, "cpu").zeros(SHAPES, [True, False, True])
    assert zeros[1] is None and [tuple(z.shape) for z in (zeros[0], zeros[2])] == [SHAPES[0], SHAPES[2]]
    assert all(float(z.abs().sum()) == 0.0 for z in (zeros[0], zeros[2]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA here: NCCL needs a GPU (benchmarks/gpu_check "
                                                           "runs this where one is lent)")
def test_one_rank_nccl_on_the_gpu_sums_in_place():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        owner = HostGradientAllreduce(SoloCollective(), [np.zeros(s, np.float32) for s in SHAPES])
        summer = TorchDeviceSum(SHAPES, "cuda:0", check_every=1)
        grads = [torch.ones(s, device="cuda:0") for s in SHAPES]
        owner.set_weight(8, 8)
        owner._take_weight()
        out = summer.reduce(owner, grads)
        assert all(o.device.type == "cuda" and float(o.sum()) == float(g.sum()) for o, g in zip(out, grads))
    finally:
        dist.destroy_process_group()


def test_steps_between_the_reads_of_a_gpu_are_checked_once_at_the_run_end(one_rank):
    """Issue 36: on a GPU the summed rows are read every 50 steps (a read waits for the device); a mismatch in
    the last steps of a run is still refused, by the one read at its end (``final_check``)."""
    owner = one_rank
    owner._engine_impl = TorchDeviceSum(SHAPES, "cpu", check_every=50)  # a GPU's interval, on CPU tensors
    grads = [torch.ones(s) for s in SHAPES]
    owner.set_weight(32, 64)  # rows other than the step's total: not read yet
    owner._take_weight()
    owner._engine_impl.reduce(owner, grads)
    with pytest.raises(RuntimeError, match="workers disagree on this step's samples"):
        owner.final_check()
