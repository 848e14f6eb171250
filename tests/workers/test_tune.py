"""Issue 27, search: ``nbdist.tune`` / ``%%dist_tune`` run Optuna trials as nbdist runs, two at once on real
local worker processes (digits): trials overlap in time, a pruned trial's workers are gone when it ends,
each stored value is its run's merged metric, ``best_model`` is the best trial's trained model, and a
search interrupted mid-way resumes from its SQLite storage without repeating finished trials."""
from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import threading
import time

import numpy as np
import psutil
import pytest

from ..conftest import wait_no_workers

optuna = pytest.importorskip("optuna")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")


def test_trials_run_concurrently_pruned_workers_stop_and_best_model_is_the_best_trials(digits, tmp_path):
    import keras

    import nbdist

    x, y = digits
    xt, yt, xv, yv = x[:600], y[:600], x[600:900], y[600:900]
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(storage=storage, study_name="lr", direction="maximize")
    for lr in (0.01, 0.02, 1e-6, 1e-6):  # two that learn, two the median pruner stops once both have completed
        study.enqueue_trial({"lr": lr})

    def build(trial):
        keras.utils.set_random_seed(trial.number)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10, activation="softmax")])
        model.compile(keras.optimizers.Adam(trial.suggest_float("lr", 1e-6, 0.1, log=True)),
                      "sparse_categorical_crossentropy", metrics=["accuracy"])
        # The median pruner decides once trials 0 and 1 are complete, which can be seconds apart on a loaded
        # machine: the two that cannot learn get epochs enough to be pruned in.
        epochs = 3 if trial.params["lr"] > 1e-3 else 40
        model.fit(xt, yt, batch_size=64, epochs=epochs, validation_data=(xv, yv), verbose=0)
        raise AssertionError("the cell stops at its model.fit")

    alive_at_end: dict[int, list[int]] = {}

    def on_trial(kind, state, number):
        if kind == "trial" and number is not None and state.trials[number].state != "running":
            alive_at_end[number] = [p for p in state.trials[number].worker_pids if psutil.pid_exists(p)
                                    and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    pruner = optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0)
    # Seeded: every trial's workers shuffle alike on each run, so the ensemble's accuracy below is a fixed number.
    search = nbdist.tune(build, trials=4, parallel=2, objective="val_accuracy", direction="maximize",
                         storage=storage, study_name="lr", pruner=pruner, listeners=[on_trial], seed=0)

    trials = {t.number: t for t in search.study.get_trials()}
    states = optuna.trial.TrialState
    assert [trials[n].state for n in range(4)] == [states.COMPLETE, states.COMPLETE, states.PRUNED, states.PRUNED], (
        search.state.trials, [t.intermediate_values for t in trials.values()])
    rows = search.state.trials
    # Two at once: each of the first two trials had its worker connected before the other one ended.
    assert rows[1].ready_at < rows[0].ended and rows[0].ready_at < rows[1].ended
    for n in (2, 3):  # pruned before their last epoch; their workers were gone when the trial ended
        assert rows[n].epochs_done < rows[n].epochs == 40 and search.jobs[n].status == "stopped"
        assert rows[n].worker_pids and alive_at_end[n] == []
    for n in (0, 1):  # the stored value is the run's merged metric at its last epoch
        assert trials[n].value == search.jobs[n].history["val_accuracy"][-1]
    best = search.study.best_trial
    assert best.number in (0, 1) and search.best_params == {"lr": best.params["lr"]}
    assert search.best_model is search.jobs[best.number].model
    # One worker per trial: its last validation ran on the weights the model now holds.
    accuracy = float((search.best_model.predict(xv, verbose=0).argmax(1) == yv).mean())
    assert accuracy == pytest.approx(best.value, abs=1e-6)
    # Each complete trial's model was saved beside the storage's file; a pruned one's was not.
    saved = {n: trials[n].user_attrs.get("nbdist_model") for n in range(4)}
    assert saved[2] is None and saved[3] is None
    assert saved[0] == str(tmp_path / "study_models" / "lr" / "trial-0.keras") and os.path.exists(saved[1])

    # Resumed in a "new session" with every trial finished: nothing runs, and best_model is the best trial's
    # model loaded from its file (the trained weights, not a fresh model); the ensemble of the best two is made
    # of the saved models too.
    again = nbdist.tune(build, trials=4, parallel=2, objective="val_accuracy", direction="maximize",
                        storage=storage, study_name="lr", pruner=pruner, ensemble=2)
    assert not again.jobs and again.best_model is not None and again.best_model is not search.best_model
    np.testing.assert_allclose(again.best_model.predict(xv, verbose=0), search.best_model.predict(xv, verbose=0),
                               atol=1e-6)
    # The ensemble: its predictions are the mean of its members' (the two complete trials, best first); on
    # held-out digits it is at least as accurate as the best single trial; it evaluates on workers, and saves
    # and loads, like any model.
    ensemble, xh, yh = again.best_ensemble, x[900:], y[900:]
    members = search.ensemble(2).members
    assert [m is search.jobs[n].model for n, m in zip((best.number, 1 - best.number), members)] == [True, True]
    want = np.mean([m.predict(xh, verbose=0) for m in members], axis=0)
    np.testing.assert_allclose(ensemble.predict(xh, verbose=0), want, atol=1e-6)
    single = max(float((m.predict(xh, verbose=0).argmax(1) == yh).mean()) for m in members)
    merged = nbdist.evaluate(ensemble, xh, yh, workers=2)
    print(f"ensemble accuracy {merged['accuracy']:.4f}, best single {single:.4f}")
    assert merged["accuracy"] >= single, (merged, single)
    assert merged["accuracy"] == pytest.approx(float((want.argmax(1) == yh).mean()), abs=1e-6)
    ensemble.save(tmp_path / "ensemble.keras")
    loaded = keras.models.load_model(tmp_path / "ensemble.keras")
    np.testing.assert_allclose(loaded.predict(xh, verbose=0), want, atol=1e-6)


def interrupt_when_a_trial_completes(db: str, stop: threading.Event, sent: threading.Event) -> threading.Thread:
    """Sends this process SIGINT (as the kernel's interrupt does) once the stored study has a complete trial.
    Reads the SQLite file itself: Optuna opening a storage that is being created would race to make it."""
    def watch():
        while not stop.is_set():
            try:  # closed at once: an open read would hold SQLite's lock against the search's writes
                with contextlib.closing(sqlite3.connect(db, timeout=1)) as con:
                    done = con.execute("SELECT count(*) FROM trials WHERE state = 'COMPLETE'").fetchall()[0][0]
            except sqlite3.Error:  # not made yet
                done = 0
            if done:
                sent.set()
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_dist_tune_interrupted_resumes_from_storage_without_repeating_finished_trials(ip, tmp_path):
    db = tmp_path / "resume.db"
    storage = f"sqlite:///{db}"
    line = (f"--trials 3 --parallel 2 --objective val_accuracy --direction maximize --storage {storage} "
            "--study resume --pruner none --seed 1 --ui none")
    cell = """
import keras
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(trial.suggest_int("units", 8, 32)),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(trial.suggest_float("lr", 1e-3, 3e-2, log=True)),
              "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(X, y, batch_size=64, epochs=later_epochs if trial.number else 1, validation_data=(Xv, yv), verbose=0)
"""
    for name in ("study", "best_model", "best_params"):
        ip.user_ns.pop(name, None)
    # The first search's later trials are long, so that the interrupt finds them running however late the
    # watcher reads the storage (a loaded machine once finished all three first); the resumed ones are short.
    ip.user_ns["later_epochs"] = 200
    stop, sent = threading.Event(), threading.Event()
    watcher = interrupt_when_a_trial_completes(str(db), stop, sent)
    try:
        ip.run_cell_magic("dist_tune", line, cell)  # trial 0 completes (1 epoch), the rest are cut short
    finally:
        stop.set()
        watcher.join(5)
    assert sent.is_set(), "the search ended before the watcher saw a complete trial"
    assert not wait_no_workers(), "an interrupt left workers behind"
    states = optuna.trial.TrialState
    first = {t.number: t for t in ip.user_ns["study"].get_trials()}
    # Trial 0 trains 1 epoch, the others 3, but which finishes first is the machine's timing: some trial did.
    assert any(t.state == states.COMPLETE for t in first.values()), [(t.number, t.state) for t in first.values()]
    assert not [t for t in first.values() if t.state == states.RUNNING]
    cut = [n for n, t in first.items() if t.state == states.FAIL]
    assert cut and all(first[n].user_attrs.get("nbdist_interrupted") for n in cut)
    complete_before = {n: t.value for n, t in first.items() if t.state == states.COMPLETE}

    ip.user_ns["later_epochs"] = 3
    ip.run_cell_magic("dist_tune", line, cell)  # resumes: only the missing trials run
    after = {t.number: t for t in ip.user_ns["study"].get_trials()}
    complete = {n: t.value for n, t in after.items() if t.state == states.COMPLETE}
    assert len(complete) == 3
    assert {n: complete[n] for n in complete_before} == complete_before  # finished trials kept, not rerun
    assert len(after) == len(first) + 3 - len(complete_before)
    assert ip.user_ns["best_params"] == ip.user_ns["study"].best_params
    # best_model is the best trial's trained model, also when that trial ran before the interrupt (loaded
    # from the file the search saved beside its storage).
    model = ip.user_ns["best_model"]
    xv, yv = ip.user_ns["Xv"], ip.user_ns["yv"]
    assert float((model.predict(xv, verbose=0).argmax(1) == yv).mean()) == pytest.approx(
        ip.user_ns["study"].best_value, abs=1e-6)
    assert np.isfinite(ip.user_ns["study"].best_value)


def test_search_is_an_mlflow_run_with_one_child_run_per_trial(digits, tmp_path):
    """With tracking on, the search is one MLflow run and each trial a child of it, logged from the notebook
    with its trial's params and merged metrics (the value Optuna stored at the last epoch)."""
    mlflow = pytest.importorskip("mlflow")
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    import nbdist

    from ..conftest import mlp

    x, y = digits

    def build(trial):
        model = mlp(trial.number, optimizer="adam")
        model.optimizer.learning_rate = trial.suggest_float("lr", 1e-3, 1e-2)
        return model

    with _use_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}"):
        search = nbdist.tune(build, trials=2, parallel=2, objective="val_accuracy", storage=f"sqlite:///{tmp_path}/s.db",
                             x=x[:400], y=y[:400], validation_data=(x[400:600], y[400:600]), epochs=2,
                             mlflow=True, run_name="lr-search", pruner="none")
        client = mlflow.MlflowClient()
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    parent = [r for r in runs if r.info.run_name == "lr-search"]
    assert len(parent) == 1 and len(runs) == 3
    children = {r.data.tags["optuna.trial"]: r for r in runs if r is not parent[0]}
    assert all(r.data.tags["mlflow.parentRunId"] == parent[0].info.run_id for r in children.values())
    for t in search.study.get_trials():
        run = children[str(t.number)]
        assert float(run.data.params["lr"]) == pytest.approx(t.params["lr"])
        assert run.data.metrics["val_accuracy"] == pytest.approx(t.value)
    assert parent[0].data.metrics["best_value"] == pytest.approx(search.study.best_value)


def test_dist_tune_without_optuna_says_what_to_install(ip, monkeypatch):
    import sys

    from IPython.core.error import UsageError

    monkeypatch.setitem(sys.modules, "optuna", None)
    with pytest.raises(UsageError, match=r"needs Optuna, which is not installed; pip install 'nbdist\[track\]'"):
        ip.run_cell_magic("dist_tune", "--trials 2 --data X,y", "ran = True\n")


def test_an_objective_the_runs_do_not_log_is_one_sentence_and_stops_every_trial(digits, tmp_path):
    import nbdist

    from ..conftest import mlp

    x, y = digits
    storage = f"sqlite:///{tmp_path / 'bad.db'}"
    with pytest.raises(nbdist.NbdistError, match=r"--objective val_acc is not a metric of these runs \(their "
                                                 r"epochs log accuracy, loss, val_accuracy, val_loss\)"):
        nbdist.tune(lambda trial: mlp(trial.number), trials=2, parallel=2, objective="val_acc", storage=storage,
                    x=x[:400], y=y[:400], validation_data=(x[400:600], y[400:600]), epochs=3)
    stored = optuna.load_study(storage=storage, study_name="nbdist-tune").get_trials()
    assert stored and all(t.state == optuna.trial.TrialState.FAIL for t in stored)


def test_trials_at_once_split_the_cores_and_fork_from_a_server_warmed_with_their_environment(digits, tmp_path):
    """Two trials of one local worker each run at once: each pinned to its own cores with its share of the
    thread budget (1 thread each on 2 cores), forked from a fork server the search started before the first
    trial with the trials' own environment, so no trial waits for TensorFlow's import."""
    from nbdist.backends.warm import POOL
    from nbdist.search.entry import make_search

    from ..conftest import mlp

    x, y = digits
    cores = os.sched_getaffinity(0)
    threads = str(max(1, len(cores) // 2))
    servers_at_first_cell: list[list[str]] = []
    seen: dict[int, tuple[set[int], str, int]] = {}  # trial -> its worker's cores, OMP_NUM_THREADS, parent pid

    def build(trial):
        import keras

        if trial.number == 0:
            servers_at_first_cell.extend(s.key.get("OMP_NUM_THREADS", "") for s in POOL.servers())
        # A notebook callback: the workers wait for the notebook at each epoch's end, so each one is still
        # there when its first merged epoch reaches the listener (13 steps an epoch end in milliseconds).
        mlp(trial.number).fit(x[:400], y[:400], epochs=3, validation_data=(x[400:600], y[400:600]),
                              callbacks=[keras.callbacks.LambdaCallback()], verbose=0)

    def on_epoch(kind, state, number):
        if kind == "epoch" and number not in seen:
            proc = psutil.Process(search.jobs[number].state.workers[0].pid)
            seen[number] = (set(proc.cpu_affinity()), proc.environ().get("OMP_NUM_THREADS", ""), proc.ppid())

    storage = f"sqlite:///{tmp_path / 's.db'}"
    search = make_search(build, trials=2, parallel=2, objective="val_accuracy", storage=storage,
                         listeners=[on_epoch], models_dir=False)
    search.run()

    rows = search.state.trials
    assert rows[1].ready_at < rows[0].ended and rows[0].ready_at < rows[1].ended  # they did run at once
    assert threads in servers_at_first_cell  # warmed before any trial, with the trials' thread budget
    servers = {s.proc.pid: s.key.get("OMP_NUM_THREADS") for s in POOL.servers()}
    for affinity, omp, parent in seen.values():
        assert servers.get(parent) == threads and omp == threads, (seen, servers)
        if len(cores) >= 2:
            assert len(affinity) == int(threads)
    if len(cores) >= 2:
        assert not seen[0][0] & seen[1][0], seen  # each trial on cores of its own


def test_dist_tune_trials_train_async(ip, tmp_path):
    """Issue 38: %%dist_tune --strategy async: each trial's two workers train against its own shared model; each
    stored value is the trial's last merged val_accuracy, which its model (best_model for the best) has."""
    line = (f"--trials 2 --parallel 2 --workers-per-trial 2 --strategy async --objective val_accuracy "
            f"--direction maximize --storage sqlite:///{tmp_path / 'async.db'} --pruner none --seed 1 --ui none")
    cell = """
import keras
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(trial.suggest_float("lr", 3e-3, 3e-2, log=True)),
              "sparse_categorical_crossentropy", metrics=["accuracy"])
model.fit(X, y, batch_size=32, epochs=2, validation_data=(Xv, yv), verbose=0)
"""
    ip.run_cell_magic("dist_tune", line, cell)
    search, study = ip.user_ns["tune_search"], ip.user_ns["study"]
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for number, job in search.jobs.items():
        assert job._async is not None and min(job.reports[r]["async_pushed"] for r in range(2)) > 0, number
        assert study.trials[number].value == job.history["val_accuracy"][-1]
    model, xv, yv = ip.user_ns["best_model"], ip.user_ns["Xv"], ip.user_ns["yv"]
    assert float(model.evaluate(xv, yv, verbose=0)[1]) == pytest.approx(study.best_value, abs=1e-6)
