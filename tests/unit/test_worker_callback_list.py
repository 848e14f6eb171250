"""The worker's callback list (worker/callback_list.py): nbdist's batch-end hooks run in order on the training
thread without the step's logs, and Keras, seeing none of them, reads the logs off that thread (issue 36: a
read waits for the GPU's step, so a read on the training thread would stop the host queueing the next step).

Keras dispatches batch ends to a thread only on backends it calls thread-safe (JAX, torch); this process runs
TensorFlow's, so the test says Keras may (the logs here are plain objects, no backend's tensors)."""
from __future__ import annotations

import threading

import keras

from nbdist.worker.callback_list import WorkerCallbacks


class Recorder(keras.callbacks.Callback):
    batch_end_in_order = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, object, str]] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.seen.append(("epoch_begin", epoch, threading.current_thread().name))

    def on_train_batch_begin(self, batch, logs=None):
        self.seen.append(("batch_begin", batch, threading.current_thread().name))

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(("batch_end", (batch, logs), threading.current_thread().name))

    def on_test_batch_end(self, batch, logs=None):
        self.seen.append(("test_batch_end", (batch, logs), threading.current_thread().name))


class Second(Recorder):
    """Another in-order hook: the two run in the list's order."""


class Safe(keras.callbacks.Callback):
    async_safe = True

    def __init__(self) -> None:
        super().__init__()
        self.logs: list[dict] = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(logs)


class SlowValue:
    """A step's loss whose read waits until the step 'finishes' (``done``), as a GPU tensor's would."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.read_on: list[str] = []

    def __float__(self) -> float:
        self.done.wait(timeout=5)
        self.read_on.append(threading.current_thread().name)
        return 1.5


def test_in_order_hooks_run_on_the_training_thread_and_keras_reads_the_logs_off_it(monkeypatch):
    monkeypatch.setattr("keras.src.backend.IS_THREAD_SAFE", True)
    first, second, safe = Recorder(), Second(), Safe()
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    listed = WorkerCallbacks([first, safe, second], model=model, epochs=1, steps=2)
    main = threading.current_thread().name
    listed.on_train_begin()
    listed.on_epoch_begin(0)
    listed.on_train_batch_begin(0)
    loss = SlowValue()
    listed.on_train_batch_end(0, {"loss": loss})
    # Back on the training thread before the step's loss could be read: nothing waited for it here.
    assert not loss.done.is_set() and loss.read_on == []
    assert first.seen == [("epoch_begin", 0, main), ("batch_begin", 0, main), ("batch_end", (0, None), main)]
    assert second.seen[-1] == ("batch_end", (0, None), main)
    loss.done.set()
    listed.on_epoch_end(0, {})  # Keras waits for its dispatched batch ends here
    assert loss.read_on and loss.read_on[0] != main and safe.logs == [{"loss": 1.5}]
    listed.on_test_begin()
    listed.on_test_batch_end(3, {"loss": 2.0})
    listed.on_test_end()
    listed.on_train_end()
    assert first.seen[-1] == ("test_batch_end", (3, None), main) and second.seen[-1][0] == "test_batch_end"
    assert first.model is model and model.history.epoch == [0]  # set_model forwarded; Keras' History kept


def test_the_list_keeps_kerases_history():
    history = WorkerCallbacks([Recorder()], model=None, epochs=2, steps=5)
    assert any(isinstance(c, keras.callbacks.History) for c in history.callbacks)
    assert history.params == {"verbose": 0, "epochs": 2, "steps": 5}

