"""Worker phase reports: time in synchronisation vs compute, and the "synchronising" state, measured
around a real Gloo allreduce between two processes where one rank arrives late."""
from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

from nbdist.driver.state import RunState
from nbdist.wire.reports import Progress, State
from nbdist.worker.phases import PhaseClock, PhaseReporter

from ..conftest import run_ranks

LATE = 1.5  # seconds rank 1 keeps rank 0 waiting


def _rank(rank: int, ports: mp.Queue, results: mp.Queue) -> None:
    from nbdist.strategies.collective import GlooCollective, open_store_listener
    from nbdist.worker.phases import PhaseClock, PhaseCollective, PhaseReporter

    listen_fd = None
    if rank == 0:
        listen_fd, port = open_store_listener("127.0.0.1")
        ports.put(port)
        ports.put(port)
    port = ports.get(timeout=30) if rank == 1 else port
    clock = PhaseClock()
    coll = PhaseCollective(GlooCollective(rank, 2, "127.0.0.1", port, 30.0, listen_fd=listen_fd), clock)
    sent: list[State] = []
    reporter = PhaseReporter(sent.append, clock, tick=0.05, interval=1.0, min_sync=0.1)
    buf = np.ones(4, dtype=np.float32)
    coll.allreduce_sum(buf)  # both present: a quick round
    reporter.start()
    time.sleep(0.3)  # "compute"
    if rank == 1:
        time.sleep(LATE)  # a slow worker: rank 0 waits in the next allreduce
    coll.allreduce_sum(buf)
    time.sleep(0.3)
    reporter.stop()
    coll.close()
    results.put((rank, sent, float(buf[0]), clock.seconds))


@pytest.fixture(scope="module")
def reports():
    return {r: tuple(rest) for r, rest in run_ranks(_rank).items()}


def test_a_worker_waiting_for_a_late_peer_reports_synchronising(reports):
    sent, value, seconds = reports[0]
    assert value == 4.0  # the allreduce really summed: 1 + 1, twice
    states = [m.state for m in sent]
    assert "synchronising" in states, states
    assert states[-1] == "training"  # and back to training once the round finished
    # The wait counts as synchronisation, live: a report during the stall already holds most of it.
    # (one report on the change, a repeat a second later while still waiting)
    during = [m.sync_seconds for m in sent if m.state == "synchronising"]
    assert len(during) >= 2 and during[-1] > 1.0, during
    assert seconds == pytest.approx(LATE, abs=0.5)
    assert sent[-1].sync_seconds == pytest.approx(seconds, abs=0.1)
    assert sent[-1].compute_seconds == pytest.approx(0.3, abs=0.25)
    # Modest rate: one tick per state change plus one a second, never a flood.
    assert len(sent) <= 2 + (0.6 + LATE) / 1.0 + 4


def test_the_late_worker_itself_mostly_computes(reports):
    sent, _, seconds = reports[1]
    assert all(m.state == "training" for m in sent)
    assert seconds < 0.3


def test_reporter_sends_on_change_and_otherwise_once_per_interval():
    now = [0.0]
    clock = PhaseClock(clock=lambda: now[0])
    sent: list[State] = []
    rep = PhaseReporter(sent.append, clock, tick=0.25, interval=1.0, min_sync=0.1)
    for _ in range(40):  # 10 s of ticks while training: one message a second
        now[0] += 0.25
        rep.report()
    assert 9 <= len(sent) <= 11
    clock.enter()
    now[0] += 0.05
    assert not rep.report()  # a 50 ms round is not worth a state change
    now[0] += 0.1
    assert rep.report() and sent[-1].state == "synchronising"
    assert sent[-1].sync_seconds == pytest.approx(0.15)
    now[0] += 0.5
    clock.leave()
    assert rep.report() and sent[-1].state == "training"
    assert sent[-1].sync_seconds == pytest.approx(0.65)


def test_driver_state_follows_phase_messages():
    st = RunState(world_size=2, epochs=3)
    st.worker_progress(0, Progress("training", epoch=1, batch=4, batches=10))
    st.worker_progress(0, State("synchronising", compute_seconds=2.0, sync_seconds=0.5))
    w = st.workers[0]
    assert (w.state, w.epoch, w.batch, w.compute_seconds, w.sync_seconds) == ("synchronising", 1, 4, 2.0, 0.5)


def test_an_allreduce_run_reports_compute_and_synchronisation_per_worker(digits, no_leftover_workers):
    import nbdist

    from ..conftest import mlp

    x, y = digits
    job = nbdist.train(mlp(seed=0), x[:600], y[:600], epochs=2, batch_size=32, workers=2, strategy="allreduce")
    assert job.status == "done" and len(job.history["loss"]) == 2
    for w in job.state.workers:
        assert w.state == "done"
        assert w.compute_seconds > 0 and 0 < w.sync_seconds < w.compute_seconds + w.sync_seconds
