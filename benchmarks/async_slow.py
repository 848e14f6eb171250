"""P12: ``--strategy async`` against ``--strategy allreduce`` on two local workers, one of them 3x slower.

The notebook's PyDataset sleeps in ``__getitem__``: PAUSE seconds a batch in one worker, three times as long
in the first worker process to read (a real slowdown, as tests/workers/test_async.py makes it). The figure
is the async run's summed epoch times over allreduce's with the slow worker; the detail gives both
strategies' times and test accuracies (digits, 450 held-out rows) with and without the slowdown.

    PYTHONPATH=. python benchmarks/async_slow.py [--epochs 10] [--pause 0.06] [--repeats 1]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SLOW = """
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
        if self.claim is None:
            return False
        try:
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
FIT = """
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(SlowBatches(Xa, ya, 64, PAUSE, CLAIM), epochs=EPOCHS, validation_data=(Xt, yt), verbose=0)
"""


def measure(epochs: int = 10, pause: float = 0.06, repeats: int = 1, backend: str = "local",
            before: Callable[[], None] | None = None) -> dict[str, Any]:
    """``backend="spark"``: the workers are tasks of the active SparkSession (P13), after a one-epoch
    warm-up run, unreported; ``before()`` runs before each measured run (P13: until warm workers wait)."""
    import time

    from IPython.core.interactiveshell import InteractiveShell
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xa, xt, ya, yt = train_test_split((x / 16).astype("float32"), y, test_size=0.25, random_state=0)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.run_cell(SLOW)
    shell.user_ns.update(Xa=xa, ya=ya, Xt=xt, yt=yt, PAUSE=pause, EPOCHS=epochs)
    out: dict[str, Any] = {"ratio": [], "epochs": epochs, "pause": pause, "backend": backend}
    line = f"--workers 2 --backend {backend} --ui none --strategy"
    if backend != "local":
        shell.user_ns.update(CLAIM=None, EPOCHS=1)
        shell.run_cell_magic("dist_train", f"{line} allreduce", FIT)
        if shell.user_ns["history_job"].status != "done":
            raise RuntimeError(f"the warm-up run failed: {shell.user_ns['history_job'].error}")
        shell.user_ns["EPOCHS"] = epochs
    with tempfile.TemporaryDirectory(prefix="nbdist-p12-") as tmp:
        for r in range(repeats):
            for slowed in (False, True):
                for strategy in ("allreduce", "async"):
                    shell.user_ns["CLAIM"] = str(Path(tmp) / f"{r}-{strategy}.pid") if slowed else None
                    if before is not None:
                        before()
                    t0 = time.perf_counter()
                    shell.run_cell_magic("dist_train", f"{line} {strategy}", FIT)
                    wall = time.perf_counter() - t0
                    job = shell.user_ns["history_job"]
                    if job.status != "done":
                        raise RuntimeError(f"{strategy} failed: {job.error}")
                    _, accuracy = shell.user_ns["model"].evaluate(xt, yt, verbose=0)
                    key = f"{strategy}{'_slow' if slowed else ''}"
                    out.setdefault(f"{key}_seconds", []).append(sum(job.state.epoch_seconds))
                    out.setdefault(f"{key}_wall", []).append(wall)  # the cell, start to return
                    out.setdefault(f"{key}_accuracy", []).append(float(accuracy))
            out["ratio"].append(out["async_slow_seconds"][-1] / out["allreduce_slow_seconds"][-1])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--pause", type=float, default=0.06)
    p.add_argument("--repeats", type=int, default=1)
    a = p.parse_args()
    print(json.dumps(measure(a.epochs, a.pause, a.repeats), indent=1))


if __name__ == "__main__":
    main()
