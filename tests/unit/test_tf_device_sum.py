"""TensorFlow's device sum (the device engine with ``TFTensors``, strategies/device_sum.py): TensorFlow's gradients
handed to torch's bucketed device sum by DLPack and back, in this process on a one-rank Gloo group on CPU tensors
(the GPU's code; one rank's sum is the identity). TensorFlow adopts only 64-byte aligned memory, so every gradient
starts on a multiple of 16 floats of its bucket; the sums come back without a copy, except a gradient Keras may
keep (a variable with ``overwrite_with_gradient``), which must not change when its bucket is refilled. The
averaging strategy's round (``TorchDeviceAverage`` with ``TFTensors``) the same way. The two-worker sum and
average run in tests/workers/test_allreduce.py. TensorFlow never runs on the GPU machines, so no test here runs
on one.
"""
from __future__ import annotations

from collections.abc import Iterator

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch.distributed as dist
from torch.utils import dlpack as torch_dlpack

from nbdist.strategies.allreduce_hook import GradientAllreduce
from nbdist.strategies.collective import SoloCollective
from nbdist.strategies.device_sum import aligned_slots, open_device_average, open_device_sum

SHAPES = [(2, 3), (3,), (17,), (5, 4)]
KEPT = [False, False, True, False]  # the third: a variable Keras assigns its gradient itself


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def owner(one_rank: None) -> GradientAllreduce:
    reducer = GradientAllreduce(SoloCollective(), [np.zeros(s, np.float32) for s in SHAPES])
    reducer._engine_impl = open_device_sum(SHAPES, "gloo", 4 * 32, None, "tensorflow", KEPT)  # 3 buckets
    return reducer


def address(t: tf.Tensor) -> int:
    return torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(t)).data_ptr()


def test_every_gradient_starts_on_64_bytes_of_its_bucket():
    assert aligned_slots([1, 16, 17, 0], 16) == [16, 16, 32, 0]


def test_a_step_comes_back_as_it_went_without_a_copy_except_a_kept_gradient(owner):
    summer = owner._engine_impl
    assert len(summer.buckets) == 3
    rng = np.random.default_rng(0)
    values = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    sparse = tf.IndexedSlices(tf.constant(values[3][[1, 3]]), tf.constant([1, 3], tf.int64), tf.constant([5, 4]))
    grads = [tf.constant(values[0]), None, tf.constant(values[2], tf.float16), sparse]
    owner.set_weight(8, 8)
    out = owner.reduce(grads)  # eagerly, as a pad step runs
    assert out[1] is None and out[2].dtype == tf.float16 and out[3].shape == (5, 4)
    np.testing.assert_array_equal(out[0].numpy(), values[0])
    np.testing.assert_array_equal(out[2].numpy(), values[2].astype(np.float16))
    np.testing.assert_array_equal(out[3].numpy(), tf.convert_to_tensor(sparse).numpy())  # summed dense
    bounds = [(b.data_ptr(), b.data_ptr() + 4 * b.numel()) for b in summer.buckets]
    assert any(a <= address(out[0]) < b for a, b in bounds)  # the bucket itself, adopted by TensorFlow
    assert address(out[0]) % 64 == 0
    kept = tf.constant(values[2])
    summed = owner.reduce([grads[0], None, kept, sparse])[2]
    assert not any(a <= address(summed) < b for a, b in bounds)  # a copy: outlives the bucket's next fill
    owner.reduce([grads[0], None, kept * 2, sparse])
    np.testing.assert_array_equal(summed.numpy(), values[2])
    assert owner.steps == 3 and owner.summed_by == "device"


def test_traced_into_a_step_it_sums_and_refuses_rows_that_disagree_with_the_total(owner):
    grads = [tf.ones(s) for s in SHAPES]
    step = tf.function(lambda *g: owner.reduce(list(g)))
    owner.set_weight(8, 8)
    out = step(*grads)
    assert all(float(tf.reduce_sum(o)) == float(np.prod(s)) for o, s in zip(out, SHAPES))
    owner.set_weight(4, 8)  # 4 rows of a step of 8: with no peer adding the other 4, the check fails
    with pytest.raises(tf.errors.OpError, match="workers disagree on this step's samples: 4 summed, 8 expected"):
        step(*grads)


def test_an_averaging_round_writes_each_variable_its_average_from_memory_of_tensorflows_own(one_rank):
    """The averaging strategy's round (``TorchDeviceAverage`` with ``TFTensors``): one rank's weighted average is
    its own variables, in buckets of 128 bytes (3 for these variables, each starting on 64 bytes), a float16 one
    cast back; the variables never keep a bucket (refilled next round), and a round of no samples (a pad) changes
    nothing."""
    rng = np.random.default_rng(1)
    values = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    variables = [keras.Variable(v, dtype="float16" if i == 2 else "float32") for i, v in enumerate(values)]
    before = [v.numpy() for v in variables]
    averager = open_device_average(variables, "gloo", 4 * 32, None, "tensorflow")
    assert len(averager.buckets) == 3 and averager.summed_by == "device"
    assert all(b.data_ptr() % 64 == 0 for b in averager.buckets)
    assert averager.average(8) == 8  # a power of two: n v / n is v exactly
    for v, want in zip(variables, before):
        assert v.dtype == want.dtype
        np.testing.assert_array_equal(v.numpy(), want)
    bounds = [(b.data_ptr(), b.data_ptr() + 4 * b.numel()) for b in averager.buckets]
    assert not any(a <= address(tf.convert_to_tensor(v)) < b for v in variables for a, b in bounds)
    for bucket in averager.buckets:
        bucket.fill_(7.0)
    assert averager.average(0) == 0  # summed samples 0: nothing to divide, the variables as they were
    for v, want in zip(variables, before):
        np.testing.assert_array_equal(v.numpy(), want)
    assert averager.rounds == 2
