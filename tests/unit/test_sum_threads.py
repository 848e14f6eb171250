"""How the chunked shared-memory sum's passes are split over a worker's threads (strategies/sum_threads.py)."""
import threading

import numpy as np
import pytest

from nbdist.strategies.direct import add_in_rank_order
from nbdist.strategies.ring import pieces
from nbdist.strategies.sum_threads import PhaseThreads, clip, run_passes, split, sum_threads


def test_a_pass_is_cut_into_consecutive_aligned_ranges_no_shorter_than_the_minimum():
    assert split(0, 1000, 4, minimum=100) == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert split(32, 1032, 4, minimum=100) == [(32, 288), (288, 544), (544, 800), (800, 1032)]  # cuts from lo
    assert split(0, 1000, 4, minimum=400) == [(0, 512), (512, 1000)]  # two ranges of >= 400 at most
    assert split(0, 1000, 4, minimum=2000) == [(0, 1000)]  # too short to pay for a thread
    assert split(5, 5, 3, minimum=1) == [(5, 5)]
    for lo, hi, threads in [(0, 2**19, 8), (48, 2**19 + 7, 3), (0, 17, 2)]:
        ranges = split(lo, hi, threads, minimum=1)
        assert ranges[0][0] == lo and ranges[-1][1] == hi and len(ranges) <= threads
        assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
        assert all((a - lo) % 16 == 0 for a, _ in ranges)


def test_clipped_pieces_cover_exactly_the_range_asked():
    offsets, sizes = [0, 2512, 2528], [2500, 7, 1301]
    parts = pieces(offsets, sizes, 2048, 3072)  # a chunk across all three arrays
    assert clip(parts, 2048, 2520) == [(0, 2048, 2500, 2048), (1, 0, 7, 2512)]
    assert clip(parts, 2516, 2600) == [(1, 4, 7, 2516), (2, 0, 72, 2528)]
    assert clip(parts, 2500, 2512) == []  # the gap between two arrays
    assert clip(parts, 2048, 3072) == parts


def test_one_thread_unless_the_environment_asks_for_more():
    assert sum_threads(8, {}) == 1
    assert sum_threads(8, {"NBDIST_SUM_THREADS": "budget"}) == 8
    assert sum_threads(8, {"NBDIST_SUM_THREADS": "1"}) == 1
    assert sum_threads(1, {"NBDIST_SUM_THREADS": "4"}) == 4
    assert sum_threads(0, {"NBDIST_SUM_THREADS": "x"}) == 1
    assert sum_threads(0, {"NBDIST_SUM_THREADS": "budget"}) == 1


@pytest.mark.parametrize("threads", [1, 2, 3, 5])
def test_passes_split_over_threads_give_the_bits_of_one_thread(threads):
    rng = np.random.default_rng(threads)
    rows = rng.standard_normal((3, 50_000)).astype(np.float32) * np.float32(1e4)
    src = rng.standard_normal(50_000).astype(np.float32)
    want_sum, want_scaled = np.empty(50_000, np.float32), np.empty(50_000, np.float32)
    add_in_rank_order(rows, want_sum)
    np.multiply(src, np.float32(0.3), out=want_scaled)
    got_sum, got_scaled = np.full(50_000, np.nan, np.float32), np.full(50_000, np.nan, np.float32)
    seen: set[str] = set()

    def add(a, b):
        seen.add(threading.current_thread().name)
        add_in_rank_order(rows[:, a:b], got_sum[a:b])

    pool = PhaseThreads(threads, timeout=10) if threads > 1 else None
    if pool is not None:
        pool.minimum = 1000
    try:
        run_passes([(0, 50_000, add), (16, 50_000, lambda a, b: np.multiply(src[a:b], np.float32(0.3),
                                                                             out=got_scaled[a:b]))], pool)
    finally:
        if pool is not None:
            pool.close()
    np.testing.assert_array_equal(got_sum, want_sum)
    np.testing.assert_array_equal(got_scaled[16:], want_scaled[16:])
    assert np.isnan(got_scaled[:16]).all()  # outside the pass's range: untouched
    assert len(seen) == threads  # every thread took a range


def test_a_failing_range_fails_the_phase_and_the_threads_stop_when_closed():
    pool = PhaseThreads(3, timeout=10)
    pool.minimum = 10

    def fail_on_a_helper(a, b):
        if threading.current_thread().name != threading.main_thread().name:
            raise ValueError(f"range {a}:{b}")

    with pytest.raises(ValueError, match="range"):
        pool.run([(0, 300, fail_on_a_helper)])
    pool.run([(0, 300, lambda a, b: None)])  # still usable
    pool.close()
    assert not any(t.is_alive() for t in pool._helpers)
