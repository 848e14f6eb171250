"""An elastic run's membership (driver/membership.py): generations, survivors, stale reports, MIN, joiners."""
from __future__ import annotations

from nbdist.driver.membership import Membership
from nbdist.driver.state import EpochAggregator
from nbdist.wire.reports import AtCommit, Lost


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


def test_a_replacement_joins_at_the_next_commit_once_it_said_hello() -> None:
    m = Membership(minimum=2, world=3)
    m.formed = True
    assert m.leave(1, "was killed by SIGKILL")
    for s in (0, 2):
        m.report(s, _lost(0, 1, 5))
    m.regroup()
    assert m.replace(1, 3, deadline=100.0) and m.starting == {3: 100.0}
    assert m.room() == 0 and not m.replace(2, 4, deadline=100.0)  # never more than the launch's world
    assert m.wants_pause()
    m.pause()
    assert not m.wants_pause()
    assert m.report(0, AtCommit(1, 2)) and m.report(2, AtCommit(1, 2))
    assert not m.ready(now=50.0)  # held for the joiner still starting
    assert m.hello(3) and m.waiting == [3] and m.ready(now=50.0)
    change = m.regroup()
    assert (change.left, change.joined, change.workers, change.committed, change.steps_lost) == ([], [3], [0, 2, 3],
                                                                                                  2, 0)
    assert change.line == "worker 3 joined at the commit after epoch 2; training with 3 workers"
    assert m.members == [0, 2, 3] and not m.pausing and m.generation == 2


def test_a_break_while_joiners_wait_takes_those_that_said_hello_and_waits_for_nobody() -> None:
    m = Membership(minimum=1, world=3)
    m.first([0, 1], "did not connect within 60 s", 0)  # worker 2 did not start in time
    m.formed = True
    assert not m.hello(5)  # not one of this run's
    assert m.hello(2) and m.room() == 0  # the late starter joins at the next change
    m.pause()
    assert m.leave(1, "was killed by SIGKILL")  # a member dies before the commit
    m.report(0, _lost(0, 3, 4))
    assert m.ready(now=0.0)
    change = m.regroup()
    assert (change.left, change.joined, change.workers, change.committed) == ([1], [2], [0, 2], 3)
    assert change.line.startswith("worker 1 left (was killed by SIGKILL) and worker 2 joined; going on with 2 workers")
    assert m.gone == {1}


def test_a_joiner_that_does_not_start_is_dropped_and_replacements_are_bounded() -> None:
    m = Membership(minimum=1, world=2)
    m.formed = True
    for new in (2, 3):  # each lost member is replaced, at most as many times as the launch's world
        assert m.leave(m.members[-1], "was killed by SIGKILL")
        m.report(0, _lost(m.generation, 0, 0))
        m.regroup()
        assert m.replace(9, new, deadline=0.0)
        assert m.hello(new)
        m.pause()
        m.report(0, AtCommit(m.generation, 0))
        assert m.regroup().joined == [new]
    m.leave(m.members[-1], "was killed by SIGKILL")
    m.report(0, _lost(m.generation, 0, 0))
    m.regroup()
    assert not m.replace(9, 4, deadline=0.0) and m.room() == 1
    pausing = Membership(minimum=1, world=2)
    pausing.formed = True
    pausing.members = [0]
    assert pausing.replace(1, 2, deadline=10.0)
    pausing.pause()
    pausing.report(0, AtCommit(0, 1))
    assert not pausing.ready(now=5.0) and pausing.ready(now=11.0)  # held until its deadline, not longer
    assert pausing.drop_joiner(2) and not pausing.drop_joiner(2)  # given up: it never said hello
    change = pausing.regroup()
    assert (change.left, change.joined, change.workers) == ([], [], [0])  # nobody came: no change to say


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
