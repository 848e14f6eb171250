"""Soak loops for the reliability claims R1 (kill -9 a worker) and R2 (interrupt the run).

Each trial starts a real 2-worker local run on scikit-learn digits, waits until training
is underway, then after a random delay either SIGKILLs one worker (R1) or sends SIGINT to
this process while ``job.wait()`` drains events on the main thread, as the kernel does (R2).
It records how long the failure (R1) or the shutdown (R2) took, whether anything hung,
and how many worker processes were left behind. ``tests/test_soak.py`` runs the same
trials; this script runs more of them and prints a table:

    python benchmarks/soak.py --trials 50
"""
from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

log = logging.getLogger("soak")

FAIL_WITHIN = 10.0  # R1: the run fails this soon after the kill
GONE_WITHIN = 5.0  # R2: every worker has exited this soon after the interrupt
HANG_AFTER = 30.0  # a run still going this long after the kill or interrupt is hung
START_LIMIT = 300.0  # worker start-up on a loaded machine is not what these trials measure


@dataclass
class Trial:
    kind: str  # "kill" | "interrupt"
    strategy: str = "averaging"
    seconds: float | None = None  # kill -> failure raised, or interrupt -> last worker gone
    hang: bool = False
    leftovers: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def worker_processes() -> list[Any]:
    """nbdist worker processes descended from this process; not the fork servers they come from, which
    wait for the next run (backends/warm.py)."""
    import psutil

    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
            if "nbdist.worker" in cmdline and "--fork-server" not in cmdline:
                out.append(child)
        except psutil.NoSuchProcess:
            continue
    return out


def wait_gone(timeout: float) -> tuple[float, int]:
    """Seconds until no worker process is left (or ``timeout``), and how many are left then."""
    start = time.monotonic()
    while True:
        left = worker_processes()
        if not left or time.monotonic() - start > timeout:
            return time.monotonic() - start, len(left)
        time.sleep(0.02)


def tiny_model(seed: int) -> Any:
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def _job(model: Any, x: np.ndarray, y: np.ndarray, listener: Any, strategy: str = "averaging") -> Any:
    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    config = TrainConfig(epochs=10_000, workers=2, batch_size=16, ui="none", strategy=strategy)
    return prepare(model, config, x, y, None, listeners=[listener])


def _when_training(after: Any, delay: float) -> Any:
    """A listener that runs ``after(state)`` on a timer ``delay`` s after the first training progress."""
    fired = threading.Event()

    def listener(kind: str, state: Any, payload: Any) -> None:
        if kind == "progress" and not fired.is_set() and any(w.state == "training" for w in state.workers):
            fired.set()
            threading.Timer(delay, after, args=(state,)).start()

    listener.fired = fired  # type: ignore[attr-defined]
    return listener


def follow(job: Any, event: dict[str, Any]) -> str:
    """Drain the run until it ends: "hang" if it outlives ``event["at"]`` by HANG_AFTER seconds,
    "no-start" if the event never happened. TrainingFailed and KeyboardInterrupt propagate."""
    t0 = time.monotonic()
    while True:
        try:
            job.wait(timeout=0.5)
            return "ended"
        except TimeoutError:
            pass
        except KeyboardInterrupt:
            job.stop("interrupted")  # it may land between two wait() calls; stop() is idempotent
            raise
        at = event.get("at")
        if at is None and time.monotonic() - t0 > START_LIMIT:
            job.stop("soak: never started")
            return "no-start"
        if at is not None and time.monotonic() - at > HANG_AFTER:
            return "hang"


def kill_trial(x: np.ndarray, y: np.ndarray, rng: random.Random, strategy: str = "averaging") -> Trial:
    """R1: SIGKILL one worker mid-epoch; the run must fail within 10 s naming it and the cause."""
    from nbdist.errors import TrainingFailed

    trial = Trial("kill", strategy)
    victim = rng.randrange(2)
    killed: dict[str, Any] = {}

    def kill(state: Any) -> None:
        pid = state.workers[victim].pid
        killed["pid"], killed["at"] = pid, time.monotonic()
        os.kill(pid, signal.SIGKILL)

    job = _job(tiny_model(rng.randrange(1000)), x, y, _when_training(kill, rng.uniform(0.0, 1.0)), strategy)
    job.start()
    try:
        outcome = follow(job, killed)
        if outcome == "hang":
            trial.hang = True
            trial.problems.append(f"hang: still running {HANG_AFTER:.0f} s after the kill ({_diagnose(job, killed)})")
            job.stop("soak: hang")
        else:
            trial.problems.append(f"the run ended without the kill ({outcome})")
    except TrainingFailed as exc:
        trial.seconds = time.monotonic() - killed.get("at", time.monotonic())
        message = str(exc)
        if f"worker {victim} (pid {killed.get('pid')})" not in message or "SIGKILL" not in message:
            trial.problems.append(f"message does not name worker {victim} and SIGKILL: {message}")
        if "\n" in message or len(message) >= 300:
            trial.problems.append(f"message is not one short sentence: {message!r}")
    if trial.seconds is not None and trial.seconds > FAIL_WITHIN:
        trial.problems.append(f"failure reported {trial.seconds:.1f} s after the kill")
    _, trial.leftovers = wait_gone(GONE_WITHIN)
    if trial.leftovers:
        trial.problems.append(f"{trial.leftovers} worker processes left behind")
    return trial


def _diagnose(job: Any, extra: Any) -> str:
    """What a hung run looked like, for the report."""
    st = job.state
    workers = [(w.rank, w.state, w.epoch, w.batch, h.exit_status()) for w, h in zip(st.workers, job._handles)]
    return f"status {st.status}, workers (rank, state, epoch, batch, exit) {workers}, {extra}"


def interrupt_trial(x: np.ndarray, y: np.ndarray, rng: random.Random, strategy: str = "averaging") -> Trial:
    """R2: KeyboardInterrupt while wait() drains events, at a random time after the first epoch."""
    trial = Trial("interrupt", strategy)
    sent: dict[str, float] = {}
    delay = rng.uniform(0.0, 0.5)
    epochs_seen = threading.Event()

    def interrupt(state: Any) -> None:
        epochs_seen.wait(120)  # the first epoch has been merged: there are weights to keep
        time.sleep(delay)
        if job.status != "running":  # never interrupt whatever runs after this trial
            return
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    base = _when_training(interrupt, 0.0)

    def listener(kind: str, state: Any, payload: Any) -> None:
        base(kind, state, payload)
        if kind == "epoch":
            epochs_seen.set()

    model = tiny_model(rng.randrange(1000))
    job = _job(model, x, y, listener, strategy)
    job.start()
    try:
        outcome = follow(job, sent)
        if outcome == "hang":
            trial.hang = True
            trial.problems.append(f"hang: still running {HANG_AFTER:.0f} s after the interrupt "
                                  f"({_diagnose(job, sent)})")
            job.stop("soak: hang")
        else:
            trial.problems.append(f"the run ended without the interrupt ({outcome})")
    except KeyboardInterrupt:
        pass
    if "at" not in sent:
        return trial
    took, trial.leftovers = wait_gone(GONE_WITHIN)
    trial.seconds = time.monotonic() - sent["at"] if not trial.leftovers else None
    check_interrupted(job, model, trial)
    return trial


def check_interrupted(job: Any, model: Any, trial: Trial) -> None:
    """After an interrupt: stopped, no workers, last synchronised weights, finished epochs kept."""
    if trial.leftovers:
        trial.problems.append(f"{trial.leftovers} worker processes left behind")
    if trial.seconds is not None and trial.seconds > GONE_WITHIN:
        trial.problems.append(f"workers gone only {trial.seconds:.1f} s after the interrupt")
    if job.status != "stopped":
        trial.problems.append(f"status {job.status!r} after an interrupt, not 'stopped'")
    epochs = len(job.history.get("loss", []))
    if epochs < 1:
        trial.problems.append("history lost the finished epochs")
    last = job._last_weights  # (epoch, weights, n_optimizer) from rank 0's last synchronisation
    if last is None:
        trial.problems.append("no synchronised weights were kept")
        return
    if last[0] not in (epochs - 1, epochs):
        trial.problems.append(f"weights from epoch {last[0]} but history has {epochs} epochs")
    if not all(np.array_equal(a, b) for a, b in zip(model.get_weights(), last[1])):
        trial.problems.append("the model does not hold the last synchronised weights")


def digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    return (x / 16).astype("float32"), y.astype("int64")


def summarise(trials: list[Trial]) -> list[dict[str, Any]]:
    rows = []
    for kind in ("kill", "interrupt"):
        ts = [t for t in trials if t.kind == kind]
        if not ts:
            continue
        secs = [t.seconds for t in ts if t.seconds is not None]
        rows.append({
            "kind": kind, "trials": len(ts), "ok": sum(t.ok for t in ts),
            "median_s": statistics.median(secs) if secs else float("nan"),
            "max_s": max(secs) if secs else float("nan"),
            "limit_s": FAIL_WITHIN if kind == "kill" else GONE_WITHIN,
            "hangs": sum(t.hang for t in ts), "leftovers": sum(t.leftovers for t in ts),
        })
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20, help="trials of each kind (default 20)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kind", choices=("kill", "interrupt", "both"), default="both")
    p.add_argument("--strategy", choices=("averaging", "allreduce", "both"), default="both",
                   help="both: the trials alternate between the two strategies")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    # A shell starts background jobs with SIGINT ignored; the interrupt trials need Python's handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    x, y = digits()
    rng = random.Random(args.seed)
    trials: list[Trial] = []
    started = time.monotonic()
    strategies = ("averaging", "allreduce") if args.strategy == "both" else (args.strategy,)
    for i in range(args.trials):
        strategy = strategies[i % len(strategies)]
        for kind, fn in (("kill", kill_trial), ("interrupt", interrupt_trial)):
            if args.kind in (kind, "both"):
                t = fn(x, y, rng, strategy)
                trials.append(t)
                if t.problems:
                    log.warning("trial %d (%s, %s): %s", i, kind, strategy, "; ".join(t.problems))
    print(f"{'kind':<10} {'trials':>6} {'ok':>4} {'median s':>9} {'max s':>7} {'limit s':>8} {'hangs':>6} "
          f"{'leftover':>9}")
    for r in summarise(trials):
        print(f"{r['kind']:<10} {r['trials']:>6} {r['ok']:>4} {r['median_s']:>9.2f} {r['max_s']:>7.2f} "
              f"{r['limit_s']:>8.1f} {r['hangs']:>6} {r['leftovers']:>9}")
    print(f"total {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
