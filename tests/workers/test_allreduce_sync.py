"""The gradient bucket's bookkeeping and its chunked, asynchronous Gloo sum.

Pure logic (per-step sample totals, the aligned bucket layout, the chunk plan) is tested
directly; the pipelined exchange itself runs between two real processes over real Gloo with
chunks small enough that every gradient is split across several asynchronous allreduces.
"""
import json

import numpy as np
import pytest

from nbdist.strategies.allreduce_hook import GradientAllreduce
from nbdist.strategies.averaging import batch_sizes
from nbdist.strategies.collective import SoloCollective
from nbdist.strategies.gradient_sum import step_totals
from nbdist.strategies.shared import ALIGN, aligned_offsets, pieces, segment_bounds

from ..ranks import run_ranks

pytestmark = pytest.mark.timeout(120)
SHAPES = [(37,), (5, 7), (100,), (3, 3, 2)]


def test_step_totals_even_uneven_and_padded_steps():
    assert step_totals([64, 64], 16) == [32, 32, 32, 32]
    # 375 / 374 / 374 / 374 samples, batch 34: 11 full steps, then worker 0's last sample alone
    # while the others pad (contribute 0).
    assert step_totals([375, 374, 374, 374], 34) == [136] * 11 + [1]
    # A short shard: 10 and 3 samples, batch 4 -> steps (4+3), (4+0 pad), (2+0 pad).
    assert step_totals([10, 3], 4) == [7, 4, 2]
    assert step_totals([3, 10], 4) == [7, 4, 2]  # the rank order does not matter
    assert step_totals([5], 5) == [5]
    assert step_totals([0, 0], 8) == []


def test_step_totals_equal_the_sum_of_every_workers_batches():
    rng = np.random.default_rng(0)
    for _ in range(50):
        shards = [int(s) for s in rng.integers(1, 200, rng.integers(1, 6))]
        b = int(rng.integers(1, 40))
        totals = step_totals(shards, b)
        assert len(totals) == max(len(batch_sizes(s, b)) for s in shards)
        assert sum(totals) == sum(shards)  # every sample counted once per epoch
        assert all(t > 0 for t in totals)  # no step without samples, so no division by zero


def test_aligned_offsets_and_chunk_plan_cover_every_gradient_element_once():
    sizes = [int(np.prod(s)) for s in SHAPES]
    offsets = aligned_offsets(sizes)
    assert all(o % ALIGN == 0 for o in offsets[:-1])
    assert all(offsets[i] + sizes[i] <= offsets[i + 1] for i in range(len(sizes)))
    length = int(offsets[-1]) + 1
    for chunk in (16, 32, 48, 1000):
        bounds = segment_bounds(0, length, chunk)
        assert bounds[0][0] == 0 and bounds[-1][1] == length
        assert all(b0[1] == b1[0] for b0, b1 in zip(bounds, bounds[1:]))  # consecutive, no gaps
        assert all(a % ALIGN == 0 for a, _ in bounds)
        seen = [np.zeros(s, int) for s in sizes]
        for a, b in bounds:
            for i, src_a, src_b, dst in pieces(offsets, sizes, a, b):
                assert a <= dst and dst + src_b - src_a <= b
                assert dst == offsets[i] + src_a
                seen[i][src_a:src_b] += 1
        assert all((s == 1).all() for s in seen)


def test_solo_exchange_returns_aligned_views_and_checks_the_total():
    reducer = GradientAllreduce(SoloCollective(), [np.zeros(s, np.float32) for s in SHAPES])
    rng = np.random.default_rng(1)
    grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    reducer.set_weight(5, 5)
    out = reducer.exchange(*grads)
    for g, o in zip(grads, out):
        assert o.shape == g.shape and o.ctypes.data % 64 == 0  # TensorFlow adopts it without a copy
        np.testing.assert_array_equal(o, g)
    reducer.set_weight(5, 7)  # a worker that believes in a total the sum does not give
    with pytest.raises(RuntimeError, match="disagree"):
        reducer.exchange(*grads)
    reducer.set_weight(5)
    with pytest.raises(RuntimeError, match="total sample count"):
        reducer.exchange(*grads)


def _grads(rank, step):
    rng = np.random.default_rng(100 * rank + step)
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


# Each step: (samples on rank 0, samples on rank 1). The last is a pad step on rank 1.
STEPS = [(3, 1), (4, 4), (2, 0)]


def _rank_main(rank: int, world: int, port: int, plans: list[list[str]]) -> None:
    """One worker of test_two_process_exchange (run in its own process): each host engine a plan names, in
    turn over one Gloo group; the report by mode."""
    from nbdist.machine.engines import Plan
    from nbdist.strategies.collective import GlooCollective
    from nbdist.worker.phases import PhaseClock, PhaseCollective

    gloo = GlooCollective(rank, world, "127.0.0.1", port, timeout=60)
    report = {}
    for engine, mode in plans:
        clock = PhaseClock()
        plan = Plan(engine, mode, bucket_bytes=256)  # chunked: rows of 64 floats
        reducer = GradientAllreduce(PhaseCollective(gloo, clock), [np.zeros(s, np.float32) for s in SHAPES], plan)
        clock.strategy_timer = reducer
        errors = []
        for step, counts in enumerate(STEPS):
            n, total = counts[rank], sum(counts)
            reducer.set_weight(n, total)
            mine = _grads(rank, step) if n else [np.zeros(s, np.float32) for s in SHAPES]
            out = reducer.exchange(*mine)
            want = [(counts[0] * a + counts[1] * b) / total for a, b in zip(_grads(0, step), _grads(1, step))]
            errors.append(max(float(np.abs(o - w).max()) for o, w in zip(out, want)))
        chunks = len(reducer._shared_plan.chunks) if reducer._shared else 0
        report[mode] = {"errors": errors, "chunks": chunks, "busy_after": clock.busy_for(), "steps": reducer.steps,
                        "seconds": reducer.seconds, "small_sum": type(reducer._shared).__name__}
        reducer.close()
    print(json.dumps({**report, **_broadcast_start(gloo, rank)}), flush=True)
    gloo.close()


def _broadcast_start(gloo, rank: int) -> dict:
    """The start of a run (broadcast_state) in the same two processes: whether each call sent the values."""
    import keras

    from nbdist.strategies.allreduce_hook import broadcast_state

    variables = [keras.Variable(np.arange(12, dtype=np.float32).reshape(3, 4)),
                 keras.Variable(np.linspace(0, 1, 5, dtype=np.float32))]
    sent = [broadcast_state(gloo, variables, compiled=True)]
    if rank == 1:
        variables[1][3].assign(variables[1][3] + 1e-6)  # one element, one rounding step: another start
    sent.append(broadcast_state(gloo, variables, compiled=True))
    return {"broadcast_sent": sent, "broadcast_values": [np.asarray(v.numpy()).tolist() for v in variables]}


PLANS = [("torch", "gloo", "NoneType"), ("shared", "chunked", "SharedChunkedSum"),
         ("shared", "small", "SharedMemorySum")]


@pytest.fixture(scope="module")
def exchanged() -> list[dict]:
    """Two real processes' reports: every host engine of ``PLANS`` in turn, then a run's start."""
    return run_ranks("tests.workers.test_allreduce_sync:_rank_main", 2, [[e, m] for e, m, _ in PLANS], timeout=120)


@pytest.mark.parametrize("engine,mode,small_sum", PLANS, ids=["chunked-allreduce", "shared-chunked", "shared-memory"])
def test_two_process_exchange_equals_the_weighted_average(exchanged, engine, mode, small_sum):
    for report in (r[mode] for r in exchanged):
        assert report["small_sum"] == small_sum
        assert report["chunks"] == {"gloo": 0, "chunked": 4, "small": 1}[mode]
        assert report["steps"] == len(STEPS) and report["seconds"] > 0
        assert max(report["errors"]) < 1e-6, report
        assert report["busy_after"] == 0.0  # the phase clock saw the exchange end


def test_a_runs_start_is_broadcast_only_where_a_worker_holds_other_values(exchanged):
    """Compared by checksum and broadcast only when a worker holds other values, then rank 0's everywhere
    (under allreduce nothing would reconcile differing replicas later)."""
    assert [r["broadcast_sent"] for r in exchanged] == [[False, True], [False, True]]
    assert exchanged[0]["broadcast_values"] == exchanged[1]["broadcast_values"]
    assert exchanged[0]["broadcast_values"][1][3] == pytest.approx(0.75)  # rank 0's


def test_tensorflow_adopts_the_averaged_gradients_without_a_copy():
    # The averaged gradients are views of the aligned bucket; TensorFlow wraps such numpy outputs
    # instead of copying them (an unaligned 100 MiB output costs a copy per step, outside the
    # timed exchange). If a TensorFlow upgrade starts copying, this shows it.
    import tensorflow as tf

    reducer = GradientAllreduce(SoloCollective(), [np.zeros(s, np.float32) for s in SHAPES])
    reducer.set_weight(2, 2)
    out = tf.function(reducer.reduce)([tf.ones(s) for s in SHAPES])
    assert all((o.numpy() == 1).all() for o in out)
    reducer.buffer[:] = 7.0
    assert all((o.numpy() == 7).all() for o in out)


def test_a_bucket_kept_by_a_variable_is_never_refilled():
    # Keras assigns the gradient itself to overwrite_with_gradient variables; an adopted view
    # makes the variable share the bucket's memory, so the next step must use another bucket.
    import tensorflow as tf

    reducer = GradientAllreduce(SoloCollective(), [np.zeros(s, np.float32) for s in SHAPES])
    v = tf.Variable(tf.zeros(SHAPES[1]))

    @tf.function
    def step(grads, keep):
        out = reducer.reduce(grads)
        if keep:
            v.assign(out[1])
        return tf.reduce_sum(out[0])

    for _ in range(3):  # the usual case: the optimizer lets go, one bucket serves every step
        reducer.set_weight(1, 1)
        step([tf.ones(s) for s in SHAPES], False)
    assert len(reducer._buckets) == 1
    reducer.set_weight(1, 1)
    step([tf.fill(s, 2.0) for s in SHAPES], True)
    for fill in (3.0, 4.0):
        reducer.set_weight(1, 1)
        step([tf.fill(s, fill) for s in SHAPES], False)
        assert (v.numpy() == 2.0).all()  # the variable's value survives later steps
    assert len(reducer._buckets) == 2

