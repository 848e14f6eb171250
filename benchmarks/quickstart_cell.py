"""P8: the quickstart's training cell from start to return, with ``%%dist_train`` on 2 warm local
workers, divided by the same cell without the magic (its body, then ``model.fit`` with the cell's
options: 20 epochs, batch 32, the validation data).

Both run in one IPython shell where TensorFlow is already imported, as in a notebook; the magic's
warm workers (started by ``%load_ext nbdist``) are ready before each run, as they are when a user
has read the first cell's output. Runs alternate, so each ratio compares runs under the same load.

    PYTHONPATH=. python benchmarks/quickstart_cell.py [--repeats 3] [--strategy averaging]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BODY = """
model = keras.Sequential([
    keras.Input((64,)),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(10, activation="softmax"),
])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""
MAGIC = "%%dist_train --data X_train,y_train --validation-data X_test,y_test --epochs {epochs} --batch-size 32 " \
        "--workers 2 --seed 0 --backend local --ui none{strategy}\n"
PLAIN = "keras.utils.set_random_seed(0)\n" + BODY + (
    "history = model.fit(X_train, y_train, validation_data=(X_test, y_test), epochs={epochs}, batch_size=32, "
    "verbose=0).history\n")


def measure(repeats: int = 3, epochs: int = 20, strategy: str | None = None) -> dict[str, list[float]]:
    import keras
    from epoch_breakdown import digits
    from first_metric import wait_warm
    from IPython.core.interactiveshell import InteractiveShell

    from nbdist.backends.local import start_warm_workers
    from nbdist.backends.warm import POOL

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    start_warm_workers(2)  # sized for the cell's 2 workers, whatever this machine's default
    x, xv, y, yv = digits()
    shell.user_ns.update({"X_train": x, "X_test": xv, "y_train": y, "y_test": yv, "keras": keras})
    shell.run_cell(PLAIN.format(epochs=1))  # the kernel has run Keras before: tracing machinery loaded
    out: dict[str, list[float]] = {"ratio": [], "magic": [], "plain": [], "magic_accuracy": [], "plain_accuracy": []}
    try:
        for _ in range(repeats):
            wait_warm(POOL)
            magic = MAGIC.format(epochs=epochs, strategy=f" --strategy {strategy}" if strategy else "") + BODY
            for kind, cell in (("magic", magic), ("plain", PLAIN.format(epochs=epochs))):
                t0 = time.perf_counter()
                result = shell.run_cell(cell)
                seconds = time.perf_counter() - t0
                if not result.success:
                    raise RuntimeError(f"the {kind} cell failed: {result.error_in_exec or result.error_before_exec}")
                out[kind].append(seconds)
                out[f"{kind}_accuracy"].append(float(shell.user_ns["history"]["val_accuracy"][-1]))
            out["ratio"].append(out["magic"][-1] / out["plain"][-1])
    finally:
        shell.run_line_magic("unload_ext", "nbdist")  # stops the warm workers
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--strategy", default=None, help="the magic line's --strategy (default: none, the default's)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    m = measure(args.repeats, args.epochs, args.strategy)
    r = m["ratio"]
    print(f"P8 quickstart cell, magic / plain: median {statistics.median(r):.2f} (min {min(r):.2f}, max {max(r):.2f}); "
          f"magic {statistics.median(m['magic']):.1f} s, plain {statistics.median(m['plain']):.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
