"""P11: a 12-trial search on digits, ``%%dist_tune`` with 2 trials at once on local workers, divided by the
same Optuna search run sequentially in the notebook process with plain ``model.fit``.

Both searches run the same trials: the 12 parameter sets (learning rate, width) are drawn once from a
seeded generator and enqueued in each study, every model is seeded by its trial number, every trial
trains the same epochs with batch 32 and validates on the quickstart's test split. No pruning for the
ratio; a third search, ``%%dist_tune`` with the median pruner, gives the epochs trained in total.
Both run in one IPython shell where TensorFlow is already imported and ``%load_ext nbdist`` ran (its
warm workers ready), as in a notebook; runs alternate, so each ratio compares runs under the same load.

    PYTHONPATH=. python benchmarks/tune_search.py [--trials 12] [--epochs 5] [--repeats 1]
"""
from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BUILD = """
keras.utils.set_random_seed(trial.number)
model = keras.Sequential([keras.Input((64,)),
                          keras.layers.Dense(trial.suggest_int("units", 16, 128), activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(trial.suggest_float("lr", 1e-4, 1e-1, log=True)),
              "sparse_categorical_crossentropy", metrics=["accuracy"])
"""
FIT = "model.fit(X_train, y_train, epochs={epochs}, batch_size=32, validation_data=(X_test, y_test), verbose=0)"
TUNE = ("%%dist_tune --trials {trials} --parallel {parallel} --objective val_accuracy --direction maximize "
        "--storage sqlite:///{db} --study {study} --pruner {pruner} --backend local --ui none --seed 0\n"
        + BUILD + FIT + "\n")
PLAIN = ("def objective(trial):\n" + "".join(f"    {ln}\n" for ln in (BUILD + FIT).strip().splitlines()
                                              if not ln.startswith("model.fit"))
         + "    return model.fit(X_train, y_train, epochs={epochs}, batch_size=32, validation_data=(X_test, y_test), "
           "verbose=0).history['val_accuracy'][-1]\n"
         "plain_study = optuna.create_study(direction='maximize', sampler=optuna.samplers.TPESampler(seed=0))\n"
         "for params in trial_params:\n    plain_study.enqueue_trial(params)\n"
         "plain_study.optimize(objective, n_trials={trials})\n")


def trial_params(trials: int) -> list[dict[str, Any]]:
    import numpy as np

    rng = np.random.default_rng(0)
    return [{"units": int(rng.integers(16, 129)), "lr": float(10 ** rng.uniform(-3.5, -1.5))} for _ in range(trials)]


def enqueue(db: Path, study: str, params: list[dict[str, Any]]) -> None:
    import optuna

    s = optuna.create_study(storage=f"sqlite:///{db}", study_name=study, direction="maximize")
    for p in params:
        s.enqueue_trial(p)


def measure(trials: int = 12, epochs: int = 5, parallel: int = 2, repeats: int = 1) -> dict[str, Any]:
    import keras
    import optuna
    from epoch_breakdown import digits
    from first_metric import wait_warm
    from IPython.core.interactiveshell import InteractiveShell

    from nbdist.backends.local import start_warm_workers
    from nbdist.backends.warm import POOL

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    start_warm_workers(parallel)  # the trials' workers, one each
    x, xv, y, yv = digits()
    params = trial_params(trials)
    shell.user_ns.update({"X_train": x, "X_test": xv, "y_train": y, "y_test": yv, "keras": keras,
                          "optuna": optuna, "trial_params": params})
    out: dict[str, Any] = {"ratio": [], "tune": [], "plain": [], "tune_best": [], "plain_best": [],
                           "pruned_seconds": [], "pruned_epochs": [], "pruned_count": [], "pruned_best": [],
                           "epochs_unpruned": trials * epochs, "trials": trials, "epochs": epochs,
                           "parallel": parallel}

    def run(cell: str) -> float:
        t0 = time.perf_counter()
        result = shell.run_cell(cell)
        seconds = time.perf_counter() - t0
        if not result.success:
            raise RuntimeError(f"the cell failed: {result.error_in_exec or result.error_before_exec}")
        return seconds

    try:
        with tempfile.TemporaryDirectory(prefix="nbdist-p11-") as tmp:
            run(PLAIN.format(epochs=1, trials=1))  # the kernel has run Keras and Optuna before
            for r in range(repeats):
                wait_warm(POOL)
                db = Path(tmp) / f"tune{r}.db"
                enqueue(db, "p11", params)
                out["tune"].append(run(TUNE.format(trials=trials, parallel=parallel, db=db, study="p11",
                                                   pruner="none", epochs=epochs)))
                out["tune_best"].append(shell.user_ns["study"].best_value)
                out["plain"].append(run(PLAIN.format(epochs=epochs, trials=trials)))
                out["plain_best"].append(shell.user_ns["plain_study"].best_value)
                out["ratio"].append(out["tune"][-1] / out["plain"][-1])
            wait_warm(POOL)
            db = Path(tmp) / "pruned.db"
            enqueue(db, "p11-pruned", params)
            out["pruned_seconds"].append(run(TUNE.format(trials=trials, parallel=parallel, db=db, study="p11-pruned",
                                                         pruner="median", epochs=epochs)))
            search = shell.user_ns["tune_search"]
            out["pruned_epochs"].append(sum(r.epochs_done for r in search.state.trials.values()))
            out["pruned_count"].append(search.state.count("pruned"))
            out["pruned_best"].append(shell.user_ns["study"].best_value)
    finally:
        shell.run_line_magic("unload_ext", "nbdist")  # stops the warm workers
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    m = measure(args.trials, args.epochs, repeats=args.repeats)
    print(f"P11 search, %%dist_tune 2 at once / sequential Optuna: median {statistics.median(m['ratio']):.2f}; "
          f"{statistics.median(m['tune']):.1f} s vs {statistics.median(m['plain']):.1f} s; best val_accuracy "
          f"{m['tune_best'][0]:.4f} vs {m['plain_best'][0]:.4f}; with the median pruner {m['pruned_epochs'][0]} of "
          f"{m['epochs_unpruned']} epochs trained ({m['pruned_count'][0]} trials pruned) in "
          f"{m['pruned_seconds'][0]:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
