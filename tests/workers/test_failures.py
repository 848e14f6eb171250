"""A worker that raises, a worker that is killed, an interrupt: fast, clear, nothing left behind."""
from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest

import nbdist
from nbdist.errors import TrainingFailed, raised_on_worker

from ..conftest import mlp, wait_no_workers

FAILING_CELL = """
import keras, tensorflow as tf

class Boom(keras.layers.Layer):
    '''Raises inside the training step once it has run 20 times: a bug in user code.'''
    def build(self, input_shape):
        self.calls = self.add_weight(shape=(), initializer="zeros", trainable=False, name="calls")
    def call(self, x, training=None):
        if training:
            self.calls.assign_add(1.0)
        tf.debugging.assert_less(self.calls, 20.0, message="injected failure in Boom")
        return x

model = keras.Sequential([keras.Input((64,)), Boom(), keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy")
"""


def test_worker_exception_fails_the_cell_with_its_traceback(ip, capsys):
    """The model's error is raised as TensorFlow raises it (issue 46), shown as the worker's traceback."""
    import tensorflow as tf

    start = time.monotonic()
    result = ip.run_cell(f"%%dist_train --data X,y --epochs 50 --workers 2 --ui none --out h\n{FAILING_CELL}")
    took = time.monotonic() - start
    assert not result.success
    error = result.error_in_exec
    assert type(error) is tf.errors.InvalidArgumentError and raised_on_worker(error), repr(error)
    assert "injected failure in Boom" in str(error)
    shown = "".join(capsys.readouterr())
    assert "--- raised on worker" in shown and "Traceback (most recent call last)" in shown
    assert "injected failure in Boom" in shown
    assert not wait_no_workers(5)
    assert took < 60  # start-up included; the failure itself is reported at once
    assert ip.user_ns["h"] == {} or all(len(v) >= 1 for v in ip.user_ns["h"].values())


def test_killed_worker_fails_the_run_naming_it(digits):
    x, y = digits
    model = mlp(seed=0)
    before = [w.copy() for w in model.get_weights()]
    killed = {}

    def kill_after_first_epoch(kind, state, payload):
        if kind == "epoch" and not killed:
            killed["pid"] = state.workers[1].pid
            killed["at"] = time.monotonic()
            os.kill(state.workers[1].pid, signal.SIGKILL)

    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    job = prepare(model, TrainConfig(epochs=200, workers=2, ui="none"), x, y, None,
                  listeners=[kill_after_first_epoch])
    job.start()
    with pytest.raises(TrainingFailed) as info:
        job.wait(timeout=120)
    assert time.monotonic() - killed["at"] < 10
    assert f"worker 1 (pid {killed['pid']})" in str(info.value)
    assert "SIGKILL" in str(info.value)
    assert job.status == "failed"
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert not wait_no_workers(5)


def test_interrupt_stops_every_worker_and_keeps_last_averaged_weights(digits):
    x, y = digits
    model = mlp(seed=0)
    before = [w.copy() for w in model.get_weights()]
    seen = {}

    def interrupt_after_two_epochs(kind, state, payload):
        if kind == "epoch" and state.epochs_done == 2 and not seen:
            seen["at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)  # what the kernel's interrupt button sends

    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    job = prepare(model, TrainConfig(epochs=200, workers=2, ui="none"), x, y, None,
                  listeners=[interrupt_after_two_epochs])
    job.start()
    with pytest.raises(KeyboardInterrupt):
        job.wait(timeout=120)
    assert not wait_no_workers(5)
    assert time.monotonic() - seen["at"] < 5
    assert job.status == "stopped"
    done = len(job.history["loss"])
    assert done >= 2 and job.weights_epoch is not None and job.weights_epoch >= 1
    assert not all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    # The next run works.
    again = nbdist.train(model, x[:400], y[:400], epochs=1, workers=2)
    assert again.status == "done"


def test_a_worker_that_exits_right_after_done_is_not_taken_for_dead(digits, monkeypatch):
    """A worker sends "done" and exits at once; its message may reach the driver after its exit is seen.

    Each "done" is held back here for a second in the driver's reader, so both processes have exited
    before their last message arrives: the run must still end "done" (it failed "exited before finishing").
    """
    from nbdist.wire import protocol
    from nbdist.wire.messages import MessageType

    recv = protocol.Channel.recv

    def late_done(self):
        msg = recv(self)
        if msg.type == MessageType.DONE:
            time.sleep(1.0)
        return msg

    monkeypatch.setattr(protocol.Channel, "recv", late_done)
    x, y = digits
    job = nbdist.train(mlp(), x[:400], y[:400], epochs=1, batch_size=32, workers=2)
    assert job.status == "done"


def test_a_connection_that_hangs_up_after_its_hello_fails_the_run_in_one_sentence(digits):
    """A peer says hello as rank 1 (it knows the secret) and hangs up before the driver sends it the job.

    The event loop died of that ("ConnectionError: worker 1 is not connected", a traceback out of the
    wait, and in a background run an "internal error"); the run must fail the way a cut connection
    does, naming the worker, and stop every process.
    """
    import socket

    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    from .test_fuzz_wire import _frame, _handshake, _hello

    x, y = digits
    # Cold workers: the fake rank 1 says hello before the real one.
    config = TrainConfig(epochs=2, workers=2, batch_size=32, ui="none", warm_workers=False)
    job = prepare(mlp(), config, x[:400], y[:400], None)
    job.start()
    # The real rank 1 is held (it is still importing TensorFlow): a rank's later connection replaces one that
    # hung up (a reconnect), and on a fast machine the real worker connected within the 2 s grace, took the
    # job and trained, so nothing failed.
    real = job._handles[1].proc.pid
    os.kill(real, signal.SIGSTOP)
    try:
        coordinator = job._coordinator
        with socket.create_connection(coordinator.address, timeout=5) as sock:
            key = _handshake(sock, coordinator.secret)
            sock.sendall(_frame(key, _hello(1)))
        deadline = time.monotonic() + 10
        while coordinator.accepted < 1 or 1 in coordinator.connected():  # its reader has seen it go
            assert time.monotonic() < deadline
            time.sleep(0.05)
        with pytest.raises(TrainingFailed, match=r"worker 1 .*closed its connection"):
            job.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(real, signal.SIGCONT)
    assert job.status == "failed"
    assert not wait_no_workers(10)
