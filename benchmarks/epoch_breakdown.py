"""P7 and the per-phase breakdown: one steady epoch of the quickstart's digits MLP, where the time goes.

Plain ``model.fit`` with batch 64 against nbdist on N local workers with batch 32 each (the same
global batch for N = 2), both strategies. Every run times its epochs the same way: from one
epoch's end to the next one's (so what Keras does between epochs counts too), and reports the
median over the epochs after the first two (tracing, warm-up). Each worker times the phases of
each epoch (worker/phases.py EpochPhases, on with TrainConfig's phase_times=True); plain fit is timed with
the same callbacks in this process; the driver times how long it spends on each kind of message.

    PYTHONPATH=. python benchmarks/epoch_breakdown.py [--epochs 12] [--repeats 3] [--workers 2]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

log = logging.getLogger("nbdist.bench")
SKIP = 2  # epochs left out of the steady median: the first traces, the second still warms up


def digits() -> tuple[Any, Any, Any, Any]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16).astype("float32")
    return train_test_split(x, y, test_size=0.25, random_state=0)  # the quickstart's split


def quickstart_model(seed: int = 0) -> Any:
    import keras

    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def steady(values: list[float]) -> float:
    return statistics.median(values[SKIP:] if len(values) > SKIP + 1 else values)


def median_phases(epochs: list[dict[str, float]]) -> dict[str, float]:
    use = epochs[SKIP:] if len(epochs) > SKIP + 1 else epochs
    return {k: statistics.median(e[k] for e in use) for k in use[0]} if use else {}


def epoch_ends(ends: list[float]) -> Any:
    """A callback appending the time at training's start and at each epoch's end to ``ends``."""
    import keras

    class Ends(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            ends.append(time.perf_counter())

        def on_epoch_end(self, epoch, logs=None):
            ends.append(time.perf_counter())

    return Ends()


def plain_fit(epochs: int, batch: int = 64) -> dict[str, Any]:
    """Plain ``fit``: epoch-end-to-epoch-end seconds and the same phase breakdown as a worker's."""

    from nbdist.worker.phases import EpochPhases

    x, xv, y, yv = digits()
    ends: list[float] = []
    phases = EpochPhases(None)
    first, last = phases.callbacks()
    quickstart_model().fit(x, y, batch_size=batch, epochs=epochs, validation_data=(xv, yv), verbose=0,
                           callbacks=[first, epoch_ends(ends), last])
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return {"epoch": steady(gaps), "epochs": gaps, "phases": median_phases(phases.epochs)}


def nbdist_fit(epochs: int, workers: int, strategy: str, batch: int = 32) -> dict[str, Any]:
    """nbdist on local workers: per-epoch seconds, each worker's phases, the driver's time per message kind."""
    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    x, xv, y, yv = digits()
    cfg = TrainConfig(epochs=epochs, batch_size=batch, workers=workers, strategy=strategy, backend="local",
                      ui="none", seed=0, phase_times=True)  # each worker times its epochs' phases
    merged_at: list[float] = []

    def listener(kind: str, state: Any, payload: Any) -> None:
        if kind == "epoch":
            merged_at.append(time.perf_counter())

    job = prepare(quickstart_model(), cfg, x, y, (xv, yv), listeners=[listener])
    driver: dict[str, list[float]] = defaultdict(list)
    handle = job._handle_message

    def timed(rank: int, msg: Any) -> None:  # the driver's own cost per message
        t0 = time.perf_counter()
        handle(rank, msg)
        driver[msg.TYPE.value].append(time.perf_counter() - t0)

    job._handle_message = timed
    job.start()
    job.wait()
    reports = [job.reports[r].get("phase_times", []) for r in range(workers)]
    # The worker's epoch ends the next epoch starts from: each epoch's total plus the gap before it.
    worker_epochs = [[e["total"] + e["between_epochs"] for e in rep[1:]] for rep in reports]
    per_epoch = [max(ws) for ws in zip(*worker_epochs)]  # the slowest worker sets the pace
    driver_gaps = [b - a for a, b in zip(merged_at, merged_at[1:])]
    n_epochs = max(1, len(merged_at))
    return {"epoch": steady([0.0] + per_epoch) if per_epoch else float("nan"),  # per_epoch starts at epoch 1
            "epochs": per_epoch, "driver_epoch": steady([0.0] + driver_gaps) if driver_gaps else float("nan"),
            "phases": [median_phases(rep) for rep in reports],
            "driver": {k: sum(v) / n_epochs for k, v in driver.items()},
            "summed_by": [job.reports[r].get("summed_by") for r in range(workers)]}


def measure(epochs: int = 12, repeats: int = 3, workers: int = 2,
            strategies: tuple[str, ...] = ("averaging", "allreduce"), batch: int = 32) -> dict[str, Any]:
    """Alternating runs (plain, then each strategy) so every ratio compares runs under the same load.

    Plain fit uses the workers' global batch, ``workers * batch``.
    """
    out: dict[str, Any] = {"plain": [], **{s: [] for s in strategies}}
    for _ in range(repeats):
        plain = plain_fit(epochs, batch=batch * workers)
        out["plain"].append(plain)
        for s in strategies:
            run = nbdist_fit(epochs, workers, s, batch)
            run["ratio"] = run["epoch"] / plain["epoch"]
            out[s].append(run)
    return out


def breakdown_table(result: dict[str, Any]) -> str:
    """Median phase milliseconds per epoch: plain fit and each worker of each strategy."""
    from nbdist.worker.phases import EpochPhases

    cols: list[tuple[str, dict[str, float]]] = [("plain fit", _median_dicts([r["phases"] for r in result["plain"]]))]
    for s in ("averaging", "allreduce"):
        for rank in range(len(result.get(s, [{}])[0].get("phases", []))):
            cols.append((f"{s[:5]} w{rank}", _median_dicts([r["phases"][rank] for r in result[s]])))
    lines = [f"{'phase (ms per epoch)':<22}" + "".join(f"{c:>12}" for c, _ in cols)]
    for p in EpochPhases.PHASES:
        lines.append(f"{p:<22}" + "".join(f"{d.get(p, 0.0) * 1e3:>12.1f}" for _, d in cols))
    plain_epoch = statistics.median(r["epoch"] for r in result["plain"])
    lines.append(f"{'epoch (end to end)':<22}" + f"{plain_epoch * 1e3:>12.1f}"
                 + "".join(f"{statistics.median(r['epoch'] for r in result[s]) * 1e3:>12.1f}"
                           for s in ("averaging", "allreduce") if s in result
                           for _ in result[s][0]["phases"]))
    for s in ("averaging", "allreduce"):
        if s not in result:
            continue
        drv = _median_dicts([r["driver"] for r in result[s]])
        every = statistics.median(r["driver_epoch"] for r in result[s])
        lines.append(f"driver, {s}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in sorted(drv.items()))
                     + f" per epoch; merged epochs every {every * 1e3:.0f} ms")
    return "\n".join(lines)


def _median_dicts(ds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in ds for k in d}
    return {k: statistics.median(d.get(k, 0.0) for d in ds) for k in keys}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="per worker; plain fit uses workers * batch")
    p.add_argument("--strategies", default="averaging,allreduce")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    r = measure(args.epochs, args.repeats, args.workers, tuple(args.strategies.split(",")), args.batch)
    print(breakdown_table(r))
    for s in args.strategies.split(","):
        ratios = [x["ratio"] for x in r[s]]
        print(f"P7 {s}, {args.workers} workers / plain fit: median {statistics.median(ratios):.2f} "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f}); epochs "
              + ", ".join(f"{x['epoch'] * 1e3:.0f}" for x in r[s]) + " ms vs plain "
              + ", ".join(f"{x['epoch'] * 1e3:.0f}" for x in r["plain"]) + " ms; summed by "
              + str(r[s][0]["summed_by"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
