"""Large buckets summed chunk by chunk through shared memory, end to end: the same training as every other path.

The digits MLP's bucket is small, so these runs shrink the segment's rows (``shared_chunk_bytes``)
and turn the one-round sum off (``direct_sum_bytes=0``) to send it through the path a 100 MiB
model takes on one machine.
"""
import keras
import numpy as np
import pytest

import nbdist
from nbdist.strategies import shared

from ..conftest import mlp as averaging_mlp
from ..conftest import relative_error
from .test_allreduce import OwnStepModel, assert_same_parameters, compiled, local_reference, mlp
from .test_training import interleave_batches

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leftover_workers"),
              pytest.mark.skipif(not shared.supported_here(), reason="shared-memory sums need x86-64 and /dev/shm")]
CHUNK_BYTES = 4096  # the MLP's 2,410 gradients (about 9.6 KiB) span 3 chunks


def own_step_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return OwnStepModel([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                         keras.layers.Dense(10, activation="softmax")])


@pytest.mark.parametrize("build", [mlp, own_step_mlp], ids=["scaled-loss", "own-train-step"])
def test_allreduce_through_chunked_shared_memory_equals_local_fit_with_the_global_batch(digits, build):
    """C3 on the chunked shared-memory path: gradients read from TensorFlow (scaled loss) or scaled as they are
    copied in; 801 rows: worker 1 runs a step with no rows of its own (zeros into the sum)."""
    x, y = digits[0][:801], digits[1][:801]
    model = compiled(build(), keras.optimizers.SGD(0.1))
    job = nbdist.train(model, x, y, epochs=1, batch_size=16, workers=2, strategy="allreduce", shuffle=False,
                       lr_scaling="none", direct_sum_bytes=0, shared_chunk_bytes=CHUNK_BYTES)
    ref = local_reference(build, keras.optimizers.SGD(0.1), x, y, workers=2, batch_size=16, epochs=1)
    assert_same_parameters(model, ref)
    assert [r["summed_by"] for r in job.reports.values()] == ["shared-chunked", "shared-chunked"]


def test_averaging_through_chunked_shared_memory_equals_big_batch_sgd(digits):
    """C2 (K=1, SGD): averaging rounds summed chunk by chunk equal local fit with batch 2b."""
    x, y = digits[0][:600], digits[1][:600]
    b = 16
    local = averaging_mlp(seed=4, optimizer=keras.optimizers.SGD(0.1))
    remote = averaging_mlp(seed=4, optimizer=keras.optimizers.SGD(0.1))
    remote.set_weights(local.get_weights())
    idx = interleave_batches(np.arange(len(x)), 2, b)
    local.fit(x[idx], y[idx], batch_size=2 * b, epochs=1, shuffle=False, verbose=0)
    job = nbdist.train(remote, x, y, epochs=1, batch_size=b, workers=2,
                       strategy="averaging", averaging_frequency=1, shuffle=False,
                       direct_sum_bytes=0, shared_chunk_bytes=CHUNK_BYTES)
    assert [job.reports[r]["summed_by"] for r in range(2)] == ["shared-chunked"] * 2
    assert relative_error(remote.get_weights(), local.get_weights()) < 1e-5
