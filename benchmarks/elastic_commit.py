"""What an elastic run's commits cost, and how long a lost worker stops training (issue 48, docs/elastic.md).

Commit cost: the steady epoch (median of the epochs after the first ``SKIP``, from one merged epoch to the
next) of an elastic run on 2 local workers (``workers="1:2"``) committing at epoch starts only and every K
steps, divided by the same run without elasticity (``workers=2``: no commits). Two models: the digits MLP
(64-64-10, Adam, batch 32 per worker, 1797 rows) and the 25.2M-parameter MLP of ``big_model.py`` (2048-4096-
4096-10, Adam, 2048 random rows, batch 32 per worker). The variants of one model alternate within each repeat,
so that each ratio compares runs under the same load.

Recovery: a 2-worker elastic run (``workers="1:2"``, a commit every step, so that every step ends a call into
TensorFlow and reports at once) loses worker 1 to SIGKILL in its second epoch; the time from the kill to the
driver's regroup (the survivor's collective failed, it reported, the next generation's job went out) and to
the first step the survivor reports after it (its model made anew, the commit put back, the step traced).
``--take-only``: one commit's copy in this process, as ``Commit.take`` makes it and as fresh copies.

    PYTHONPATH=. python benchmarks/elastic_commit.py [--quick] [--repeats 2] [--models digits,big]
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS: tuple[Any, ...] = ("none", "epoch", 100, 10, 1)  # no elasticity, then commits at epoch starts / every K
SKIP = 2  # epochs left out of the steady median (tracing, warm-up)


def model_and_data(kind: str, quick: bool) -> tuple[Any, Any, Any, int]:
    """(model, x, y, epochs) for ``kind``: the digits MLP or the big MLP (``--quick``: 1.6M parameters)."""
    import big_model
    import keras

    if kind == "big":
        size = big_model.sizes(quick)
        x, y = big_model.data(size["features"], size["rows"])
        return big_model.build(size["features"], size["hidden"]), x, y, 3 if quick else 5
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, (x / 16.0).astype("float32"), y, 6 if quick else 12


def steady_epoch(kind: str, variant: Any, quick: bool) -> float:
    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    model, x, y, epochs = model_and_data(kind, quick)
    elastic = {} if variant == "none" else {"workers": "1:2", "commit_every": None if variant == "epoch" else variant}
    cfg = TrainConfig(**{"workers": 2, **elastic}, epochs=epochs, batch_size=32, ui="none", seed=0)
    ends: list[float] = []
    job = prepare(model, cfg, x, y, None, listeners=[lambda kind, state, payload: kind == "epoch" and ends.append(
        time.perf_counter())])
    job.start()
    job.wait(timeout=1800)
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    return statistics.median(gaps[SKIP - 1:] if len(gaps) >= SKIP else gaps)


def take_seconds(kind: str, quick: bool, repeats: int = 5) -> dict[str, float]:
    """One commit's copy in this process, best of ``repeats``: as ``Commit.take`` does it (one copy from host
    memory into the older commit's buffers) and as fresh copies of ``numpy()`` (before commit 741e9b1)."""
    import numpy as np

    from nbdist.worker.elastic import Commit, state_variables

    model = model_and_data(kind, quick)[0]
    model.optimizer.build(model.trainable_variables)  # Adam's slots: the state a running fit holds
    commit = Commit()

    def best(fn: Any) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    for _ in range(2):
        commit.take(model, 0)  # two commits held: the next one reuses the older one's buffers
    mb = sum(a.nbytes for a in commit.latest.values) / 2**20
    return {"state_mb": mb, "take_s": best(lambda: commit.take(model, 0)),
            "fresh_copies_s": best(lambda: [np.array(v.numpy(), copy=True) for v in state_variables(model)])}


def recovery(kind: str, quick: bool) -> dict[str, float]:
    """Seconds from a SIGKILL of worker 1 in the second epoch to the regroup and to the survivor's next step."""
    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    model, x, y, _ = model_and_data(kind, quick)
    marks: dict[str, float] = {}

    def listener(event: str, state: Any, payload: Any) -> None:
        now = time.perf_counter()
        if event == "progress" and "kill" not in marks and state.epochs_done >= 1:
            marks["kill"] = now
            os.kill(state.workers[1].pid, signal.SIGKILL)
        elif event == "membership" and payload.left and "regroup" not in marks:  # not its replacement's join
            marks["regroup"] = now
        elif event == "progress" and "regroup" in marks and "first_step" not in marks:
            marks["first_step"] = now

    cfg = TrainConfig(workers="1:2", commit_every=1, epochs=3, batch_size=32, ui="none", seed=0)
    job = prepare(model, cfg, x, y, None, listeners=[listener])
    job.start()
    job.wait(timeout=1800)
    (change, *_) = [c for c in job.state.membership if c.left]
    return {"regroup_s": marks["regroup"] - marks["kill"], "first_step_s": marks["first_step"] - marks["kill"],
            "steps_lost": change.steps_lost}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--models", default="digits,big")
    p.add_argument("--variants", default=",".join(map(str, VARIANTS)), help="a subset of none,epoch,100,10,1")
    p.add_argument("--no-recovery", action="store_true", help="the commit costs only")
    p.add_argument("--take-only", action="store_true", help="only one commit's copy, in this process")
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args()
    if args.take_only:
        for kind in args.models.split(","):
            t = take_seconds(kind, args.quick)
            print(f"{kind}: a commit of {t['state_mb']:.1f} MB takes {1e3 * t['take_s']:.1f} ms; as fresh copies "
                  f"{1e3 * t['fresh_copies_s']:.1f} ms (load average {os.getloadavg()[0]:.1f})")
        return
    import big_model

    big_model.warm_up()
    load = os.getloadavg()[0]
    out: dict[str, Any] = {"load_before": load, "models": {}}
    variants = [v if v in ("none", "epoch") else int(v) for v in args.variants.split(",")]
    for kind in args.models.split(","):
        epochs: dict[str, list[float]] = {str(v): [] for v in variants}
        recoveries = []
        for _ in range(args.repeats):  # the variants alternate: each repeat's ratios share its load
            for variant in variants:
                epochs[str(variant)].append(steady_epoch(kind, variant, args.quick))
            if not args.no_recovery:
                recoveries.append(recovery(kind, args.quick))
        base = statistics.median(epochs["none"])
        out["models"][kind] = {"epoch_s": epochs, "recovery": recoveries,
                               "ratio": {v: statistics.median(e) / base for v, e in epochs.items()}}
        print(f"{kind}: steady epoch without elasticity {base:.3f} s")
        for v in variants[1:]:
            name = "epoch starts" if v == "epoch" else f"every {v} steps"
            runs = ", ".join(f"{e:.3f}" for e in epochs[str(v)])
            print(f"  commits at {name:<16} {statistics.median(epochs[str(v)]):.3f} s  ratio "
                  f"{out['models'][kind]['ratio'][str(v)]:.2f}  (runs: {runs})")
        for r in recoveries:
            print(f"  kill -> regroup {r['regroup_s']:.2f} s, -> first step after {r['first_step_s']:.2f} s "
                  f"({r['steps_lost']} steps lost)")
    out["load_after"] = os.getloadavg()[0]
    print(f"load average (1 min) before {load:.1f}, after {out['load_after']:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
