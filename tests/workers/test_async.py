"""--strategy async (issue 38): a worker 3x slower slows only its own contribution. Real workers, digits.

The slowdown is real: the notebook's PyDataset sleeps in ``__getitem__``, three times longer in the
first worker process that reads from it (claimed through a file) than in the other.
"""
from __future__ import annotations

import os

import pytest

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

SLOW_CELL = """
import os, time
import keras, numpy as np
class SlowBatches(keras.utils.PyDataset):
    def __init__(self, x, y, batch, pause, claim=None, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch, self.pause, self.claim = x, y, batch, pause, claim
        self.owner = os.getpid()  # the notebook reads batch 0 to check it: never slowed
    def __len__(self):
        return -(-len(self.x) // self.batch)
    def _slow(self):
        if self.claim is None or os.getpid() == self.owner:
            return False
        try:  # the first worker process to read claims the slowdown
            fd = os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode()); os.close(fd)
        except FileExistsError:
            pass
        with open(self.claim) as f:
            return f.read() == str(os.getpid())
    def __getitem__(self, i):
        if os.getpid() != self.owner:
            time.sleep(self.pause * (3 if self._slow() else 1))
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]
"""

FIT_CELL = """
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(SlowBatches(Xa, ya, 64, PAUSE, CLAIM), epochs=EPOCHS, validation_data=(Xt, yt), verbose=0)
"""


def _run(ip, strategy: str, claim: str | None) -> tuple[float, float, object]:
    ip.user_ns["CLAIM"] = claim
    ip.run_cell_magic("dist_train", f"--workers 2 --strategy {strategy} --ui none", FIT_CELL)
    job = ip.user_ns["history_job"]
    assert job.status == "done", job.error
    _, accuracy = ip.user_ns["model"].evaluate(ip.user_ns["Xt"], ip.user_ns["yt"], verbose=0)
    return sum(job.state.epoch_seconds), accuracy, job


def test_async_is_not_held_back_by_a_slow_worker_and_matches_allreduce(ip, digits_split, tmp_path):
    x_train, x_test, y_train, y_test = digits_split
    ip.run_cell(SLOW_CELL)
    ip.user_ns.update(Xa=x_train, ya=y_train, Xt=x_test, yt=y_test, PAUSE=0.06, EPOCHS=10)
    seconds, accuracy = {}, {}
    for slowed in (False, True):
        for strategy in ("allreduce", "async"):
            claim = str(tmp_path / f"{strategy}-{slowed}.pid") if slowed else None
            seconds[strategy, slowed], accuracy[strategy, slowed], job = _run(ip, strategy, claim)
            if slowed:
                assert os.path.exists(claim)  # a worker was slowed
            if strategy == "async":
                pushed = {r: job.reports[r]["async_pushed"] for r in job.reports}
                assert all(n > 0 for n in pushed.values()), pushed
    print("seconds", seconds, "accuracy", accuracy)
    assert seconds["async", True] <= 0.6 * seconds["allreduce", True], seconds
    for slowed in (False, True):
        assert abs(accuracy["async", slowed] - accuracy["allreduce", slowed]) <= 0.01, accuracy
