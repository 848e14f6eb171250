"""Several steps per call (worker/blocks.py): every call ends where an averaging round or the pass ends."""
from __future__ import annotations

import pytest

from nbdist.strategies.averaging import sync_after
from nbdist.worker.blocks import BatchSpan, block_size, steps_in_call


def calls(steps: int, block: int) -> list[range]:
    """The batches each of Keras' calls runs in one pass: it starts calls at 0, B, 2B, ..."""
    return [range(b, b + steps_in_call(b, block, steps)) for b in range(0, steps, block)]


@pytest.mark.parametrize("every", [1, 2, 3, 5, 7, 10, 12, 16, 32, 97, 100, 1000])
@pytest.mark.parametrize("steps", [1, 4, 5, 22, 23, 100])
def test_every_round_ends_a_call_and_the_calls_cover_the_pass_once(every, steps):
    block = block_size(every, steps)
    assert 1 <= block <= 16
    runs = calls(steps, block)
    assert [b for r in runs for b in r] == list(range(steps))  # each batch once, in order, nothing past the pass
    ends = {r[-1] for r in runs}
    assert {b for b in range(steps) if sync_after(b, steps, every)} <= ends


def test_the_block_is_as_large_as_the_rounds_allow():
    assert block_size(5, 23) == 5  # the quickstart: a round every 5 batches
    assert block_size(12, 100) == 12
    assert block_size(100, 1000) == 10  # the largest divisor of 100 up to 16
    assert block_size(97, 1000) == 1  # a prime above the cap: one step per call, as before
    assert block_size(1000, 23) == 16  # one round per epoch, at its end
    assert block_size(5, 3) == 3
    with pytest.raises(ValueError):
        block_size(0, 5)


def test_a_span_counts_each_batch_once_and_stops_at_the_pass_end():
    span = BatchSpan([32] * 7)
    assert list(span.advance(4)) == [0, 1, 2, 3, 4]
    assert list(span.advance(9)) == [5, 6]  # Keras reports the call's last as 9: past the pass
    assert span.next == 7 and list(span.advance(9)) == []
    span.reset()
    assert list(span.advance(0)) == [0]
