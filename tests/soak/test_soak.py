"""R1 and R2 soak loops (marker ``soak``; the default run executes them).

The default run (CI's) does 4 trials of each (each trial starts two workers that import
TensorFlow, ~10 s); ``NBDIST_SOAK_TRIALS=20`` gives the issue's 20, and
``benchmarks/soak.py --trials N`` prints the same loops as a table.

Trials alternate between ``--strategy averaging`` and ``allreduce``.

R1: kill -9 one worker at a random time once training is underway: each run
fails within 10 s naming the worker and the signal; no hang; no process left.
R2: interrupt at a random time after the first epoch (half through the API's
``job.wait()``, half through ``%%dist_train`` in a real IPython shell): every worker gone
within 5 s, the model holds the last synchronised weights, the history keeps the finished
epochs, and the next run (the next trial) works. ``benchmarks/soak.py`` runs more trials.
"""
from __future__ import annotations

import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import soak

from ..conftest import ipython_shell

pytestmark = pytest.mark.soak
TRIALS = int(os.environ.get("NBDIST_SOAK_TRIALS", "4"))


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """A shell starts background jobs with SIGINT ignored; these trials need Python's handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


STRATEGIES = ("averaging", "allreduce")


def report(trials: list[soak.Trial]) -> str:
    rows = soak.summarise(trials)
    problems = [f"{t.kind} ({t.strategy}): {p}" for t in trials for p in t.problems]
    return f"{rows}\n" + "\n".join(problems)


# Each trial starts two TensorFlow workers: ~5 s on an idle 2-core machine, far more when loaded.
LIMIT = pytest.mark.timeout(120 + 90 * TRIALS)


def accept_threads() -> int:
    return sum(t.name == "nbdist-accept" and t.is_alive() for t in threading.enumerate())


@LIMIT
def test_killing_a_worker_mid_epoch_fails_the_run_fast_and_leaves_nothing(digits):
    """R1: a worker killed mid-epoch fails the run within the limit, with no hang and no leftovers."""
    x, y = digits
    rng = random.Random(1)
    trials = [soak.kill_trial(x, y, rng, STRATEGIES[i % 2]) for i in range(TRIALS)]
    print(soak.summarise(trials))
    assert all(t.ok for t in trials), report(trials)
    assert sum(t.hang for t in trials) == 0 and sum(t.leftovers for t in trials) == 0
    assert max(t.seconds for t in trials) < soak.FAIL_WITHIN
    assert accept_threads() == 0  # each run's coordinator closed its port and its thread


@LIMIT
def test_interrupting_job_wait_stops_every_worker(digits):
    """R2: KeyboardInterrupt in ``job.wait()`` stops every worker and leaves nothing."""
    x, y = digits
    rng = random.Random(2)
    trials = [soak.interrupt_trial(x, y, rng, STRATEGIES[i % 2]) for i in range(TRIALS - TRIALS // 2)]
    print(soak.summarise(trials))
    assert all(t.ok for t in trials), report(trials)
    assert max(t.seconds for t in trials) < soak.GONE_WITHIN


INTERRUPT_CELL = """
import keras
keras.utils.set_random_seed({seed})
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""


def interrupt_cell_trial(ip, rng: random.Random) -> soak.Trial:
    """One R2 trial through the magic: SIGINT lands while the cell drains events."""
    trial = soak.Trial("interrupt")
    sent: dict[str, float] = {}
    delay = rng.uniform(0.0, 0.5)
    done = threading.Event()

    def interrupt_after_first_epoch() -> None:
        while not done.is_set():  # `soak_h` grows when the first epoch has been merged
            job = ip.user_ns.get("soak_h_job")
            if job is not None and job.history.get("loss"):
                time.sleep(delay)
                if job.status == "running":
                    sent["at"] = time.monotonic()
                    os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.02)

    ip.user_ns.pop("soak_h_job", None)
    threading.Thread(target=interrupt_after_first_epoch, daemon=True).start()
    try:
        result = ip.run_cell("%%dist_train --data X,y --epochs 10000 --batch-size 16 --workers 2 --ui none "
                             f"--out soak_h\n{INTERRUPT_CELL.format(seed=rng.randrange(1000))}")
    finally:
        done.set()
    if not result.success:
        trial.problems.append(f"the cell failed: {result.error_in_exec!r}")
    if "at" not in sent:
        trial.problems.append("the interrupt was never sent")
        return trial
    took, trial.leftovers = soak.wait_gone(soak.GONE_WITHIN)
    trial.seconds = time.monotonic() - sent["at"] if not trial.leftovers else None
    job = ip.user_ns["soak_h_job"]
    soak.check_interrupted(job, ip.user_ns["model"], trial)
    if ip.user_ns["soak_h"] != job.history:
        trial.problems.append("the notebook's history is not the run's history")
    return trial


@LIMIT
def test_interrupting_a_dist_train_cell_stops_every_worker(digits):
    """R2: KeyboardInterrupt in a running ``%%dist_train`` cell stops every worker within the limit."""
    x, y = digits
    ip = ipython_shell()
    ip.user_ns.update(X=x, y=y)
    rng = random.Random(3)
    trials = [interrupt_cell_trial(ip, rng) for _ in range(TRIALS // 2)]
    print(soak.summarise(trials))
    assert all(t.ok for t in trials), report(trials)
    assert max(t.seconds for t in trials) < soak.GONE_WITHIN
    # After the interrupts, a run to the end works and writes back.
    result = ip.run_cell(f"%%dist_train --data X,y --epochs 1 --workers 2 --ui none --out soak_h\n"
                         f"{INTERRUPT_CELL.format(seed=0)}")
    assert result.success and len(ip.user_ns["soak_h"]["loss"]) == 1
    assert not soak.worker_processes()


def test_second_interrupt_while_stopping_still_stops_everything(digits):
    """Users press interrupt twice: the second one lands inside stop(), which must still finish."""
    x, y = digits
    sent: dict[str, float] = {}
    epoch_done = threading.Event()
    followed = threading.Event()

    def interrupt_twice(state):
        epoch_done.wait(120)
        sent["at"] = time.monotonic()
        # The first interrupt starts stop(); keep interrupting until it has finished.
        while job.status == "running" and not followed.is_set() and time.monotonic() - sent["at"] < 2.0:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.02)

    base = soak._when_training(interrupt_twice, 0.0)

    def listener(kind, state, payload):
        base(kind, state, payload)
        if kind == "epoch":
            epoch_done.set()

    model = soak.tiny_model(0)
    job = soak._job(model, x, y, listener)
    job.start()
    try:
        try:
            soak.follow(job, sent)
        except KeyboardInterrupt:
            pass
        followed.set()
        time.sleep(1.0)  # if the second interrupt comes after stop() returned, it lands here
    except KeyboardInterrupt:
        pass
    took, left = soak.wait_gone(soak.GONE_WITHIN)
    assert left == 0 and time.monotonic() - sent["at"] < soak.GONE_WITHIN + 1.0
    trial = soak.Trial("interrupt", seconds=None, leftovers=left)
    soak.check_interrupted(job, model, trial)
    assert trial.ok, trial.problems
