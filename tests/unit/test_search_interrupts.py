"""An interrupt during a search's storage call (nbdist/search/study.py ``HeldStorage``): raised when the call
returns, never inside it. Cut inside a write, SQLAlchemy left SQLite's database locked and the search could
not tell its running trials failed (a CI run's resumed search found one still RUNNING). The kernel's interrupt
is this process's own SIGINT, sent while the call runs."""
from __future__ import annotations

import os
import signal

import pytest

optuna = pytest.importorskip("optuna")


class Recording:
    """A storage whose one call is interrupted halfway (SIGINT to this process, as the kernel sends it)."""

    def __init__(self) -> None:
        self.finished = False
        self.limit = 3

    def set_trial_intermediate_value(self, trial_id: int, step: int, value: float) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        self.finished = True  # Python runs the handler before this line unless the interrupt is held


@pytest.fixture(autouse=True)
def python_sigint():
    """Python's own SIGINT handler for each test (an earlier test's SparkContext leaves PySpark's installed)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_during_a_storage_call_is_raised_when_it_returns_and_nested_holds_leave_it_to_the_outer():
    from nbdist.driver.interrupts import interrupts_held
    from nbdist.search.study import HeldStorage

    inner = Recording()
    held = HeldStorage(inner)
    assert held.limit == 3  # attributes pass through
    with pytest.raises(KeyboardInterrupt):
        held.set_trial_intermediate_value(0, 1, 0.5)
    assert inner.finished
    # Inside a block that swallows presses (a search stopping its trials): the storage's hold leaves the press
    # to it, so the stop is not cut short.
    inner.finished = False
    try:
        with interrupts_held():
            held.set_trial_intermediate_value(0, 2, 0.5)
    except KeyboardInterrupt:
        pytest.fail("the storage's hold raised a press inside a block that swallows them")
    assert inner.finished
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_interrupts_in_reports_leave_the_sqlite_study_writable(tmp_path):
    """Many reports, each series cut by an interrupt at a different moment: every trial can still be told
    failed (on the old storage, SQLite's "database is locked" came within a few dozen)."""
    from nbdist.search.study import open_study

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = open_study(optuna, study=None, storage=f"sqlite:///{tmp_path / 'cut.db'}", study_name="cut",
                       direction="maximize", sampler=None, pruner=None, seed=1)
    previous = signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))
    try:
        for attempt in range(60):
            trial = study.ask()
            try:
                signal.setitimer(signal.ITIMER_REAL, 0.0005 * (1 + attempt % 7))
                for step in range(20_000):
                    trial.report(float(step), step)
            except KeyboardInterrupt:
                pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            study.tell(trial, state=optuna.trial.TrialState.FAIL)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.FAIL] * 60
