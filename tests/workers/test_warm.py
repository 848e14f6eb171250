"""Warm local workers (backends/warm.py): started ahead of a job, TensorFlow already imported.

Real worker processes throughout: a job must take the warm ones (same pids), train correctly,
pin every thread they already run, and leave a fresh set warming for the next job; closing the
pool leaves no process behind.
"""
import os
import shutil
import subprocess
import sys
import time

import keras
import pytest

import nbdist
from nbdist.backends import warm
from nbdist.backends.command import worker_env
from nbdist.backends.local import start_warm_workers
from nbdist.backends.warm import POOL, WarmPool, WarmWorker
from nbdist.placement import threads_per_worker
from nbdist.procs import pin_to_cores

from ..conftest import ipython_shell, wait_no_workers, worker_processes

pytestmark = pytest.mark.timeout(300)


def _wait_ready(count: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while POOL.ready_count() < count:
        assert time.monotonic() < deadline, f"{count} warm workers not ready within {timeout} s"
        time.sleep(0.2)


def _mlp():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def test_a_job_takes_the_warm_workers_and_the_next_set_warms(digits, monkeypatch):
    monkeypatch.setenv(warm.ENV_COUNT, "2")
    try:
        assert start_warm_workers() == 2
        _wait_ready(2)
        first = {w.proc.pid for w in POOL._workers}
        x, y = digits
        model = _mlp()
        job = nbdist.train(model, x, y, epochs=5, batch_size=32, workers=2, ui="none")
        assert {w.pid for w in job.state.workers} == first  # no worker was started for the job
        assert len(job.history["loss"]) == 5 and job.history["loss"][-1] < job.history["loss"][0]
        assert job.history["accuracy"][-1] > 0.6  # it learned (chance is 0.1; 0.80-0.9 seen here)
        # The job over, the next set is warming: new processes, ready in the background.
        _wait_ready(2)
        second = {w.proc.pid for w in POOL._workers}
        assert len(second) == 2 and not second & first
    finally:
        POOL.close()
    assert wait_no_workers() == []
    assert POOL._dir is None


def test_a_worker_that_connects_after_the_rendezvous_still_gets_it(digits, monkeypatch):
    # One warm worker for a 2-worker job: rank 0 (warm) connects and publishes the Gloo store
    # seconds before rank 1 (cold) has imported TensorFlow. Rank 1 must still be told where
    # the store is; it used to wait for the startup timeout instead.
    monkeypatch.setenv(warm.ENV_COUNT, "1")
    try:
        POOL.enable(1, worker_env(threads_per_worker(2)))  # what a 2-worker job's workers get
        _wait_ready(1)
        x, y = digits
        job = nbdist.train(_mlp(), x, y, epochs=2, batch_size=32, workers=2, ui="none", startup_timeout=40)
        assert job.status == "done" and len(job.history["loss"]) == 2
    finally:
        POOL.close()
    assert wait_no_workers() == []


def test_warm_workers_outlive_the_thread_that_started_them(monkeypatch):
    # A background job ends on its own thread, which starts the next warm set. Workers told to
    # die with their parent (PR_SET_PDEATHSIG) would die with that thread: the "parent" is the
    # thread that spawned them. Here the thread lives until the workers are ready, then ends.
    import threading

    monkeypatch.setenv(warm.ENV_COUNT, "2")
    try:
        starter = threading.Thread(target=lambda: (start_warm_workers(), _wait_ready(2)))
        starter.start()
        starter.join(200)
        assert not starter.is_alive()
        time.sleep(1.0)
        assert POOL.ready_count() == 2
    finally:
        POOL.close()
    assert wait_no_workers() == []


def test_pinning_reaches_the_threads_a_warm_worker_already_runs():
    code = ("import threading, time; [threading.Thread(target=time.sleep, args=(60,), daemon=True).start() "
            "for _ in range(3)]; print('up', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        core = min(os.sched_getaffinity(0))
        pin_to_cores(child.pid, {core})
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) == 4
        assert all(os.sched_getaffinity(int(t)) == {core} for t in tids)
    finally:
        child.kill()
        child.wait()


def test_a_job_takes_only_workers_started_with_its_environment():
    pool = WarmPool()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [subprocess.Popen(sleeper, stdin=subprocess.PIPE) for _ in range(3)]
    try:
        a, b = {"OMP_NUM_THREADS": "1"}, {"OMP_NUM_THREADS": "2"}
        pool._workers = [WarmWorker(procs[0], warm.Path("/nonexistent"), a),
                         WarmWorker(procs[1], warm.Path("/nonexistent"), b),
                         WarmWorker(procs[2], warm.Path("/nonexistent"), a)]
        procs[2].kill()
        procs[2].wait()
        taken = pool.take(2, a)  # the other environment's worker and the dead one are not taken
        assert [w.proc for w in taken] == [procs[0]]
        assert pool.take(1, {"OMP_NUM_THREADS": "3"}) == []
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("line, code, says", [
    (b"", 0, "warm: ready for a job"),  # the pool let it go: stdin closed, nothing to do
    (b"not json\n", 2, "malformed job line"),
])
def test_a_warm_worker_without_a_job_exits_with_one_line(line, code, says):
    proc = subprocess.run([sys.executable, "-m", "nbdist.worker", "--warm"], input=line, capture_output=True,
                          env=worker_env(1), timeout=180)
    out = proc.stderr.decode()
    assert proc.returncode == code and says in out, out[-2000:]
    assert "Traceback" not in out


def test_the_extension_starts_warm_workers_and_unloading_stops_them(monkeypatch):
    shell = ipython_shell()  # the session's shell: its magics must be registered again afterwards
    monkeypatch.setenv(warm.ENV_COUNT, "1")
    try:
        nbdist.load_ipython_extension(shell)
        assert POOL.enabled and len(worker_processes()) == 1
        nbdist.unload_ipython_extension(shell)
        assert not POOL.enabled and wait_no_workers() == []
    finally:
        monkeypatch.setenv(warm.ENV_COUNT, "0")
        nbdist.load_ipython_extension(shell)
    assert not POOL.enabled and "dist_train" in shell.magics_manager.magics["cell"]


def test_warm_workers_exit_when_the_kernel_is_killed():
    # Without PR_SET_PDEATHSIG, a waiting warm worker ends on its stdin's EOF: a kernel killed
    # with SIGKILL leaves no process behind.
    import psutil

    code = ("import os, sys, time; os.environ['NBDIST_WARM_WORKERS'] = '2'; "
            "from nbdist.backends.local import start_warm_workers; from nbdist.backends.warm import POOL; "
            "start_warm_workers(); [time.sleep(0.2) for _ in iter(lambda: POOL.ready_count() < 2, False)]; "
            "print(POOL._dir, *[w.proc.pid for w in POOL._workers], flush=True); time.sleep(120)")
    kernel = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        warm_dir, *pids = kernel.stdout.readline().split()
        pids = [int(p) for p in pids]
        assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    finally:
        kernel.kill()
        kernel.wait()
    deadline = time.monotonic() + 15
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(p) for p in pids)
    shutil.rmtree(warm_dir)  # the workers' logs: a killed kernel cannot remove them (README)


def _running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
