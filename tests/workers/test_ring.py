"""The ring that sums arrays across workers straight into one bucket (strategies/ring.py).

The plan (blocks, segments, which array parts fall where) is pure and checked directly; the ring
itself runs between 2 and 3 real processes over real Gloo, on a layout with alignment gaps, arrays
split across segments, segments made of several arrays and a one-element count, and is compared
with numpy's sum. Its inputs are read-only arrays, as TensorFlow lends them.
"""
import json

import numpy as np
import pytest

from nbdist.strategies.ring import aligned_offsets, block_bounds, plan, ring_schedule, segment_bounds

from ..ranks import run_ranks

pytestmark = pytest.mark.timeout(150)
SIZES = [37, 35, 1000, 18, 5000, 3, 1]  # the last: a sample count, as the gradient allreduce appends


def _layout():
    offsets = aligned_offsets(SIZES)
    return [int(o) for o in offsets[:-1]], int(offsets[-1])


def test_blocks_and_segments_cover_the_bucket_once_at_aligned_cuts():
    for length, world in [(0, 2), (5, 2), (100, 3), (1601, 2), (4096, 4), (17, 5)]:
        blocks = block_bounds(length, world)
        assert len(blocks) == world and blocks[0][0] == 0 and blocks[-1][1] == length
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
        assert all(a % 16 == 0 or a == length for a, _ in blocks)
        for a, b in blocks:
            segs = segment_bounds(a, b, 48)
            assert sum(e - s for s, e in segs) == b - a
            assert all(e - s <= 48 for s, e in segs)


def test_plan_puts_every_array_element_in_exactly_one_segment():
    offsets, length = _layout()
    for world, segment in [(2, 64), (3, 16), (4, 1000)]:
        seen = [np.zeros(n, int) for n in SIZES]
        for block in plan(offsets, SIZES, length, world, segment):
            for seg in block:
                for i, lo, hi, pos in seg.parts:
                    assert seg.start <= pos and pos + hi - lo <= seg.end and pos == offsets[i] + lo
                    seen[i][lo:hi] += 1
        assert all((s == 1).all() for s in seen)


def test_a_segment_one_array_covers_is_sent_without_a_copy():
    offsets, length = _layout()
    singles = [seg.single_source() for block in plan(offsets, SIZES, length, 2, 64) for seg in block]
    assert any(s is not None for s in singles)  # inside the 1000- and 5000-element arrays
    assert any(s is None for s in singles)  # the small arrays share segments


def test_ring_schedule_visits_every_block_and_ends_with_the_whole_bucket():
    for world in (2, 3, 4, 5):
        # Simulate the ring on sets of contributors: block b at rank r holds the ranks summed into it.
        held = [[{r} for _ in range(world)] for r in range(world)]
        schedules = [ring_schedule(r, world) for r in range(world)]
        for step in range(world - 1):
            msgs = [(r, schedules[r][0][step][0], set(held[r][schedules[r][0][step][0]])) for r in range(world)]
            for r, block, contrib in msgs:
                nxt = (r + 1) % world
                assert schedules[nxt][0][step][1] == block
                held[nxt][block] = contrib | {nxt}
        for r in range(world):  # after reduce-scatter: block r + 1 is complete at rank r
            assert held[r][(r + 1) % world] == set(range(world))
        for step in range(world - 1):
            msgs = [(r, schedules[r][1][step][0], set(held[r][schedules[r][1][step][0]])) for r in range(world)]
            for r, block, contrib in msgs:
                assert contrib == set(range(world))  # only finished blocks travel in the all-gather
                nxt = (r + 1) % world
                assert schedules[nxt][1][step][1] == block
                held[nxt][block] = contrib
        assert all(h == set(range(world)) for row in held for h in row)


def _arrays(rank, step):
    rng = np.random.default_rng(1000 * rank + step)
    out = []
    for n in SIZES:
        a = rng.standard_normal(n).astype(np.float32)
        a.flags.writeable = False  # as TensorFlow lends them
        out.append(a)
    return out


def _rank_main(rank: int, world: int, port: int, segment: int) -> None:
    from nbdist.strategies.collective import GlooCollective
    from nbdist.strategies.ring import RingSum

    gloo = GlooCollective(rank, world, "127.0.0.1", port, timeout=60)
    offsets, length = _layout()
    ring = RingSum(rank, world, offsets, SIZES, length, timeout=60, segment=segment)
    errors = []
    out = np.full(length, np.nan, dtype=np.float32)
    for step in range(3):
        mine = _arrays(rank, step)
        ring(mine, out)
        want = [sum(_arrays(r, step)[i].astype(np.float64) for r in range(world)) for i in range(len(SIZES))]
        errors.append(max(float(np.abs(out[o:o + n] - w).max()) for o, n, w in zip(offsets, SIZES, want)))
        assert all((a == b).all() for a, b in zip(mine, _arrays(rank, step)))  # inputs untouched
    print(json.dumps({"errors": errors}), flush=True)
    gloo.close()


@pytest.mark.parametrize("world,segment", [(2, 64), (3, 32), (2, 2**20)])
def test_ring_sum_between_real_processes_equals_numpy(world, segment):
    for report in run_ranks("tests.workers.test_ring:_rank_main", world, segment):
        assert max(report["errors"]) < 1e-5
