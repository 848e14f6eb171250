"""P5: seconds from a ``%%dist_train`` cell starting to its first epoch metric on screen.

Runs the real magic in an IPython shell with the text renderer and stamps the moment
the first "Epoch" line is written to the cell's output. As in a notebook, TensorFlow is
already imported in the kernel. Warm (the default): ``%load_ext nbdist`` has started the
fork server, which imports TensorFlow while the user writes the cell, so each repeat first waits
until it is ready; each job's workers are forked from it (backends/warm.py). Cold
(``--cold``): warm workers are off and each run starts its own, importing TensorFlow.

    PYTHONPATH=. python benchmarks/first_metric.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

CELL = """
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""


class StampedStream(io.TextIOBase):
    """Stands in for the cell's stdout; remembers when the first epoch line arrived."""

    def __init__(self, real) -> None:
        self.real = real
        self.first_epoch: float | None = None
        self.text = []

    def write(self, s: str) -> int:
        if self.first_epoch is None and "Epoch " in s:
            self.first_epoch = time.perf_counter()
        self.text.append(s)
        return len(s)

    def flush(self) -> None:
        pass


def measure(repeats: int = 3, workers: int = 2, epochs: int = 3, warm: bool = True) -> list[float]:
    import keras
    from IPython.core.interactiveshell import InteractiveShell
    from sklearn.datasets import load_digits

    from nbdist.backends.local import start_warm_workers
    from nbdist.backends.warm import POOL

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    if warm:
        start_warm_workers(workers)  # sized for the run's workers, whatever this machine's default
    else:
        shell.run_line_magic("config", "DistMagics.warm_workers = False")  # stops the one the load started
    x, y = load_digits(return_X_y=True)
    shell.user_ns.update({"X": (x / 16).astype("float32"), "y": y, "keras": keras})
    line = f"--data X,y --epochs {epochs} --batch-size 32 --workers {workers} --backend local --ui text"
    seconds = []
    for _ in range(repeats):
        if warm:
            wait_warm(POOL)
        real, stream = sys.stdout, StampedStream(sys.stdout)
        sys.stdout = stream
        try:
            t0 = time.perf_counter()
            result = shell.run_cell(f"%%dist_train {line}\n{CELL}")
        finally:
            sys.stdout = real
        if not result.success or stream.first_epoch is None:
            raise RuntimeError(f"the cell did not show an epoch metric: {''.join(stream.text)[-500:]}")
        seconds.append(stream.first_epoch - t0)
    shell.run_line_magic("unload_ext", "nbdist")  # stops the warm workers
    return seconds


def wait_warm(pool, timeout: float = 300.0) -> None:
    """Until the fork server started by ``%load_ext nbdist`` has done its imports (backends/warm.py)."""
    deadline = time.monotonic() + timeout
    while not (pool.servers() and all(s.ready() for s in pool.servers())):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the fork server was not ready within {timeout:.0f} s")
        time.sleep(0.2)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cold", action="store_true", help="no warm workers: each run starts its own")
    args = p.parse_args()
    s = measure(args.repeats, warm=not args.cold)
    print(f"cell start to first metric: median {statistics.median(s):.2f} s, min {min(s):.2f}, "
          f"max {max(s):.2f} (goal <= 6 s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
