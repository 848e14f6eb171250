"""TensorFlow's device sum (``TFDeviceSum``, strategies/tf_device_sum.py): TensorFlow's gradients handed to torch's
bucketed device sum by DLPack and back, in this process on a one-rank Gloo group on CPU tensors (the GPU's code;
one rank's sum is the identity). TensorFlow adopts only 64-byte aligned memory, so every gradient starts on a
multiple of 16 floats of its bucket; the sums come back without a copy, except a gradient Keras may keep (a
variable with ``overwrite_with_gradient``), which must not change when its bucket is refilled. The two-worker sum
runs in tests/workers/test_allreduce.py. TensorFlow never runs on the GPU machines, so no test here runs on one.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tensorflow as tf
import torch.distributed as dist
from torch.utils import dlpack as torch_dlpack

from nbdist.strategies.allreduce_hook import GradientAllreduce
from nbdist.strategies.collective import SoloCollective
from nbdist.strategies.device_sum import aligned_slots
from nbdist.strategies.tf_device_sum import TFDeviceSum

SHAPES = [(2, 3), (3,), (17,), (5, 4)]
KEPT = [False, False, True, False]  # the third: a variable Keras assigns its gradient itself


@pytest.fixture
def owner() -> Iterator[GradientAllreduce]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        reducer = GradientAllreduce(SoloCollective(), [np.zeros(s, np.float32) for s in SHAPES], "gloo")
        reducer._engine_impl = TFDeviceSum(SHAPES, "gloo", KEPT, bucket_bytes=4 * 32)  # 3 buckets
        yield reducer
    finally:
        dist.destroy_process_group()


def address(t: tf.Tensor) -> int:
    return torch_dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(t)).data_ptr()


def test_every_gradient_starts_on_64_bytes_of_its_bucket():
    assert aligned_slots([1, 16, 17, 0], 16) == [16, 16, 32, 0]


def test_a_step_comes_back_as_it_went_without_a_copy_except_a_kept_gradient(owner):
    summer = owner._engine_impl
    assert len(summer.sum.buckets) == 3
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
    bounds = [(b.data_ptr(), b.data_ptr() + 4 * b.numel()) for b in summer.sum.buckets]
    assert any(a <= address(out[0]) < b for a, b in bounds)  # the bucket itself, adopted by TensorFlow
    assert address(out[0]) % 64 == 0
    kept = tf.constant(values[2])
    summed = owner.reduce([grads[0], None, kept, sparse])[2]
    assert not any(a <= address(summed) < b for a, b in bounds)  # a copy: outlives the bucket's next fill
    owner.reduce([grads[0], None, kept * 2, sparse])
    np.testing.assert_array_equal(summed.numpy(), values[2])
    assert summer.steps == 3 and owner.summed_by == "device"


def test_traced_into_a_step_it_sums_and_refuses_rows_that_disagree_with_the_total(owner):
    grads = [tf.ones(s) for s in SHAPES]
    step = tf.function(lambda *g: owner.reduce(list(g)))
    owner.set_weight(8, 8)
    out = step(*grads)
    assert all(float(tf.reduce_sum(o)) == float(np.prod(s)) for o, s in zip(out, SHAPES))
    owner.set_weight(4, 8)  # 4 rows of a step of 8: with no peer adding the other 4, the check fails
    with pytest.raises(tf.errors.OpError, match="workers disagree on this step's samples: 4 summed, 8 expected"):
        step(*grads)
