"""An elastic run's membership (driver/membership.py): generations, survivors, stale reports, MIN."""
from __future__ import annotations

from nbdist.driver.membership import Membership
from nbdist.driver.state import EpochAggregator
from nbdist.wire.reports import Lost


def _lost(generation: int, committed: int, steps: int) -> Lost:
    return Lost(generation, committed, steps, "RuntimeError", "RuntimeError: worker 2 exited", "Traceback ...")


def test_a_generation_regroups_over_its_survivors_once_all_reported() -> None:
    m = Membership(minimum=2, world=4)
    assert m.leave(3, "was killed by SIGKILL") and m.broken
    assert m.survivors == [0, 1, 2]
    assert m.report(0, _lost(0, 2, 5)) and m.report(2, _lost(0, 2, 7))
    assert not m.ready()
    assert not m.report(1, _lost(1, 2, 5))  # another generation's: dropped
    assert m.report(1, _lost(0, 2, 6)) and m.ready()
    change = m.regroup()
    assert (change.generation, change.left, change.workers, change.committed, change.steps_lost) == \
        (1, [3], [0, 1, 2], 2, 7)
    assert "worker 3 left (was killed by SIGKILL)" in change.line and "7 steps lost" in change.line
    assert m.members == [0, 1, 2] and m.slot(2) == 2 and not m.broken and m.generation == 1
    assert not m.report(3, _lost(1, 2, 0))  # gone: not a member any more


def test_below_min_is_said_and_a_second_loss_while_broken_counts() -> None:
    m = Membership(minimum=2, world=3)
    assert m.leave(0, "was killed by SIGKILL")
    assert not m.leave(2, "exited with code 9")  # one left: below MIN
    assert m.survivors == [1] and m.gone == {0, 2}


def test_epochs_every_survivor_reported_merge_without_the_one_that_left() -> None:
    report = {"logs": {"loss": 1.0}, "samples": 10, "val_samples": 0, "seconds": 1.0}
    agg = EpochAggregator(3)
    agg.add(0, 4, report)
    agg.add(2, 4, report)
    agg.add(2, 5, report)
    complete = agg.without({1}, 2)
    assert [(epoch, len(reports)) for epoch, reports in complete] == [(4, 2)]
    assert agg.add(0, 5, report) is not None  # counted over the two left


def test_a_mid_epoch_regroup_goes_on_from_the_oldest_commit_every_survivor_holds() -> None:
    m = Membership(minimum=2, world=3)
    m.leave(2, "was killed by SIGKILL")
    # Worker 1 committed after step 8 of epoch 2; worker 0's collective broke before it did (it holds step 4).
    m.report(0, Lost(0, 2, 3, "E", "E: gone", "", step=4))
    m.report(1, Lost(0, 2, 0, "E", "E: gone", "", step=8))
    change = m.regroup()
    assert (change.committed, change.step) == (2, 4)
    assert change.steps_lost == 4  # worker 1 goes back past its 4 steps after the point
    assert "from the commit after epoch 2 and 4 steps of the next, 4 steps lost" in change.line
