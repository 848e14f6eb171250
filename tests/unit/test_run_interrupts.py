"""An interrupt while a run or a search is followed (driver/run.py ``wait``, search/scheduler.py ``run``;
driver/interrupts.py ``interrupts_noted``): the kernel's SIGINT is noted and acted on between steps. Raised where it
landed, a KeyboardInterrupt inside a garbage collector's callback was printed as "Exception ignored" and lost, and
the run went on to its last epoch (tests/notebook/test_dashboard.py saw it in 2 of 3 full-suite runs). The kernel's
interrupt is this process's own SIGINT, here sent from inside a weakref's callback."""
from __future__ import annotations

import gc
import os
import signal
import sys
import weakref
from types import SimpleNamespace

import pytest

from nbdist.driver.interrupts import interrupts_held, interrupts_noted


@pytest.fixture(autouse=True)
def python_sigint():
    """Python's own SIGINT handler for each test (an earlier test's SparkContext leaves PySpark's installed)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class Thing:
    pass


def interrupt_inside_a_weakref_callback() -> bool:
    """SIGINT sent from inside a weakref's callback, as the garbage collector runs it; whether the callback ran
    to its end (Python runs a handler at the next instruction, inside the callback)."""
    finished = []

    def callback(_ref: weakref.ref) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        finished.append(True)

    thing = Thing()
    ref = weakref.ref(thing, callback)
    del thing
    gc.collect()
    assert ref() is None
    return bool(finished)


def test_python_loses_a_keyboard_interrupt_raised_in_a_weakref_callback(monkeypatch):
    """Why the interrupt is only noted: the default handler's KeyboardInterrupt never reaches the run's loop."""
    ignored = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: ignored.append(unraisable.exc_type))
    assert not interrupt_inside_a_weakref_callback()  # the callback was cut short by the KeyboardInterrupt ...
    assert ignored == [KeyboardInterrupt]  # ... which Python passed to its "Exception ignored" hook, and dropped


def test_an_interrupt_noted_while_a_run_is_followed_is_kept_and_the_handler_given_back():
    with interrupts_noted() as pressed:
        assert interrupt_inside_a_weakref_callback()
        assert pressed == [signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with interrupts_held(), interrupts_noted() as inner:  # a stop under way decides what a press does
        os.kill(os.getpid(), signal.SIGINT)
    assert inner == []


def test_a_second_press_before_the_first_was_acted_on_raises_at_once():
    """A notebook callback that hangs (the run's loop never gets to act on the first press) can be broken out of."""
    reached = []
    with pytest.raises(KeyboardInterrupt), interrupts_noted() as pressed:
        os.kill(os.getpid(), signal.SIGINT)
        reached.append(1)  # the first press is only noted
        os.kill(os.getpid(), signal.SIGINT)
        reached.append(2)
    assert reached == [1] and pressed == [signal.SIGINT, signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_wait_stops_the_run_and_raises_the_noted_interrupt():
    from nbdist.driver.run import Run

    class Following(Run):
        """The loop of ``wait`` alone: the first pump's SIGINT lands in a garbage collector's callback."""

        def __init__(self) -> None:  # only what wait and stop read
            self.state, self.stopped, self.pumps = SimpleNamespace(status="running"), None, 0
            self._failure = None

        def _in_background(self) -> bool:
            return False

        def pump(self, timeout: float) -> None:
            self.pumps += 1
            assert self.pumps < 10, "the interrupt was lost: the run went on"
            interrupt_inside_a_weakref_callback()

        def stop(self, reason: str = "stopped") -> None:
            self.stopped, self.state.status = reason, "stopped"

    run = Following()
    with pytest.raises(KeyboardInterrupt):
        run.wait()
    assert run.stopped == "interrupted" and run.pumps == 1


def test_a_search_stops_its_trials_and_raises_the_noted_interrupt():
    """%%dist_tune's loop pumps its trials' jobs itself (nbdist/search/scheduler.py): the same noted interrupt."""
    pytest.importorskip("optuna")
    from nbdist.search.scheduler import Search

    class Job:
        status, pumps = "running", 0

        def pump(self, timeout: float) -> None:
            self.pumps += 1
            assert self.pumps < 10, "the interrupt was lost: the search went on"
            interrupt_inside_a_weakref_callback()

    class Searching(Search):
        """The loop of ``run`` alone, one trial running: its pump's SIGINT lands in a garbage collector's callback."""

        def __init__(self) -> None:  # only what run and its loop read
            self.running = {0: SimpleNamespace(job=Job(), prune=False)}
            self.state = SimpleNamespace(parallel=1, finished=None, finish=lambda status, message="": setattr(
                self.state, "finished", status))
            self.listeners, self._error, self.stopped = [], None, None

        def _warm_trials(self) -> None:
            pass

        def _remaining(self) -> int:
            return 0

        def _stop_all(self, reason: str) -> None:
            self.stopped = reason

        def _end(self) -> None:
            pass

    search = Searching()
    with pytest.raises(KeyboardInterrupt):
        search.run()
    assert search.stopped == "interrupted" and search.state.finished == "interrupted"
    assert search.running[0].job.pumps == 1
