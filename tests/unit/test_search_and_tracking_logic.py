"""Issue 27's pure pieces: the search's state and table, the direction a metric implies, the tracking
options' checks and what a run logs as parameters (no process, no MLflow store)."""
from __future__ import annotations

import os
import signal

import pytest

from nbdist.config import TrainConfig
from nbdist.driver.search_state import SearchState
from nbdist.errors import NbdistError
from nbdist.fit_arguments import FitCall
from nbdist.search.study import infer_direction
from nbdist.ui.search import search_rows, search_sentence, search_text
from nbdist.ui.tracking import model_requirements, run_params, unreachable


def test_search_state_tracks_the_best_complete_trial_in_its_direction():
    state = SearchState("val_accuracy", "maximize", n_trials=4, parallel=2, previous=1)
    for n, lr in enumerate((0.1, 0.01, 0.001)):
        state.trial_started(n, {"lr": lr}, epochs=3)
    for value in (0.5, 0.7, 0.8):
        state.trial_epoch(0, value)
    state.trial_epoch(1, 0.95)  # pruned after one epoch: never the best, however good its step was
    state.trial_ended(1, "pruned")
    state.trial_ended(0, "complete", 0.8)
    state.trial_epoch(2, 0.6)
    assert (state.best_number, state.best_value) == (0, 0.8)
    assert [r.number for r in state.running] == [2]
    rows = search_rows(state)
    assert rows[0] == ["0", "complete", "lr=0.1", "3/3", "0.8", "0.8"]
    assert rows[1][:2] == ["1", "pruned"] and rows[2][1] == "running"
    assert "3/4 trials finished" in search_sentence(state) and "best val_accuracy 0.8 (trial 0" in search_text(state)
    state.finish("interrupted")
    assert state.trials[2].state == "interrupted"
    minimize = SearchState("val_loss", "minimize", n_trials=2, parallel=1)
    assert minimize.better(0.1, 0.2) and not minimize.better(0.3, 0.2)


@pytest.mark.parametrize("metric,direction", [("val_loss", "minimize"), ("val_accuracy", "maximize"),
                                              ("mae", "minimize"), ("auc", "maximize")])
def test_direction_follows_the_metric(metric, direction):
    assert infer_direction(metric) == direction


def test_tracking_options_are_checked_in_one_sentence():
    with pytest.raises(NbdistError, match="--mlflow-active 'both': use nest"):
        TrainConfig(mlflow_active="both")
    with pytest.raises(NbdistError, match="--run-name must be a non-empty name"):
        TrainConfig(run_name=" ")


def test_run_params_hold_options_fit_arguments_and_optimizer_config():
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    fit = FitCall(given=frozenset({"batch_size", "epochs", "class_weight"}), batch_size=64, epochs=3, shuffle=True,
                  class_weight={0: 2.0}, callbacks=[keras.callbacks.EarlyStopping()], validation_data=None)
    params = run_params(TrainConfig(epochs=3, strategy="allreduce", seed=7), model, fit)
    assert params["fit.batch_size"] == "64" and params["fit.class_weight"] == "{0: 2.0}"
    assert "fit.shuffle" not in params  # not given in the call
    assert params["fit.callbacks"] == "EarlyStopping" and "averaging_frequency" not in params
    assert params["optimizer"] == "SGD" and float(params["optimizer.momentum"]) == pytest.approx(0.9)
    assert (params["strategy"], params["seed"], params["model.parameters"]) == ("allreduce", "7", "10")


def test_a_logged_models_requirements_are_keras_and_its_backend_as_installed():
    from importlib.metadata import version

    for backend, names in (("tensorflow", ("keras", "tensorflow")), ("jax", ("keras", "jax", "jaxlib")),
                           ("torch", ("keras", "torch"))):
        assert model_requirements(backend) == [f"{n}=={version(n)}" for n in names], backend
    assert model_requirements("numpy") is None  # a backend nbdist cannot name: MLflow infers them


def test_only_http_tracking_uris_are_probed():
    assert unreachable("sqlite:///mlflow.db") is None and unreachable("databricks") is None


def test_text_view_says_each_ended_trial_and_the_table_at_the_end():
    import io

    from nbdist.ui.search import TextSearchView, search_html

    out = io.StringIO()
    view = TextSearchView(out)
    state = SearchState("val_loss", "minimize", n_trials=2, parallel=2)
    state.trial_started(0, {"units": 32}, epochs=2)
    view("trial", state, 0)
    assert out.getvalue() == ""  # a trial that starts is in the table, not a line of its own
    state.trial_epoch(0, 0.5)
    state.trial_ended(0, "pruned")
    view("trial", state, 0)
    state.finish("done")
    view("end", state, None)
    lines = out.getvalue().splitlines()
    assert lines[0] == "trial 0 pruned: units=32; val_loss 0.5 after 1/2 epochs (per epoch: 0.5)"
    assert lines[1].startswith("search done: 1/2 trials finished") and "units=32" in lines[-1]
    assert "<td>pruned</td>" in search_html(state)


def test_charts_show_the_best_so_far_over_sessions_and_each_trials_curve():
    """The best-so-far line starts from the earlier sessions' best and counts their trials; every trial with an
    epoch has its curve, running ones marked; the SVG (HTML/Zeppelin) and text views draw the same points."""
    from nbdist.ui.search import best_so_far_line, search_charts, search_html, svg_chart

    state = SearchState("val_accuracy", "maximize", n_trials=6, parallel=2, previous=2, previous_best=0.7)
    for n, curve, end in ((2, [0.5, 0.6], "complete"), (3, [0.8, 0.9], "complete"), (4, [0.4], "pruned"),
                          (5, [0.3, 0.95], None)):
        state.trial_started(n, {"lr": 0.01}, epochs=2)
        for v in curve:
            state.trial_epoch(n, v)
        if end:
            state.trial_ended(n, end)
    charts = search_charts(state)
    assert list(zip(charts.best.x, charts.best.y)) == [(3, 0.7), (4, 0.9), (5, 0.9)]  # trial 2 (0.6) < 0.7
    assert [(c.label, c.y, c.running) for c in charts.curves] == [
        ("trial 2", [0.5, 0.6], False), ("trial 3", [0.8, 0.9], False), ("trial 4", [0.4], False),
        ("trial 5", [0.3, 0.95], True)]
    assert charts.curves[0].x == [1, 2]
    svg = svg_chart("t", "epoch", charts.curves, width=250, height=140)
    assert svg.count("<polyline") == 4 and svg.count("<circle") == 7
    # x from 1 to 2 maps to 50..240, y from 0.3 to 0.95 to 108..24: trial 5's points
    assert 'data-label="trial 5" fill="none" stroke="#1f77b4" stroke-width="2.5" points="50.0,108.0 240.0,24.0"' in svg
    assert search_html(state).count("<svg") == 2
    assert best_so_far_line(state) == "best val_accuracy after each finished trial: 3: 0.7, 4: 0.9, 5: 0.9"


def test_widget_view_draws_the_charts_and_table_throttling_epochs():
    pytest.importorskip("bqplot")
    from nbdist.ui.search_widgets import WidgetSearchView

    shown = []
    view = WidgetSearchView(show=shown.append)
    state = SearchState("val_loss", "minimize", n_trials=2, parallel=2)
    view("start", state, None)
    assert shown == [view.root] and view.best.figure.title == "best val_loss so far"
    state.trial_started(0, {"units": 8}, epochs=3)
    view("trial", state, 0)
    state.trial_epoch(0, 0.9)
    view("epoch", state, 0)  # within REDRAW_SECONDS of the last draw: skipped
    assert view.draws == 2 and "trial 0" not in view.curves.lines
    state.trial_epoch(0, 0.5)
    state.trial_ended(0, "complete")
    view("trial", state, 0)
    line = view.curves.lines["trial 0"]
    assert list(line.x) == [1, 2] and list(line.y) == [0.9, 0.5] and list(line.colors) == ["#2ca02c"]
    assert list(view.best.lines["best so far"].y) == [0.5]
    assert "<td>complete</td>" in view.table.value


def test_an_interrupt_as_a_trial_is_asked_for_stops_the_search_and_marks_that_trial(monkeypatch, tmp_path):
    """The kernel's interrupt landing while the study hands out a trial (held to the end of that step): the
    search stops with the trial told failed (interrupted) in the study and in the run state, no KeyError."""
    optuna = pytest.importorskip("optuna")
    from nbdist.search.entry import make_search
    from nbdist.search.study import INTERRUPTED

    search = make_search(lambda trial: None, trials=2, parallel=1, objective="val_loss", backend="containers",
                         storage=f"sqlite:///{tmp_path / 'study.db'}", models_dir=False)
    ask = search.study.ask

    def ask_then_interrupt(*args, **kwargs):
        trial = ask(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return trial

    monkeypatch.setattr(search.study, "ask", ask_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        search.run()
    [trial] = search.study.get_trials()
    assert trial.state == optuna.trial.TrialState.FAIL and trial.user_attrs[INTERRUPTED]
    assert search.state.trials[trial.number].state == "interrupted" and search.state.status == "interrupted"


@pytest.mark.parametrize("storage", ["memory", "sqlite"])
@pytest.mark.parametrize("order", [(1, 0), (0, 1)])
def test_best_model_is_the_study_best_trials_when_two_trials_tie(storage, order, tmp_path):
    """Two trials end with the same value, in either order (as two parallel trials can): the search
    hands out the model of the trial the study calls best, whichever its storage picks, never the one that
    happened to finish first (a full CI run once saw the two disagree)."""
    import types

    optuna = pytest.importorskip("optuna")
    from nbdist.search.scheduler import Search, TrialRun

    url = None if storage == "memory" else f"sqlite:///{tmp_path / 'tie.db'}"
    study = optuna.create_study(storage=url, direction="maximize")
    search = Search(lambda trial: None, study=study, optuna=optuna, n_trials=2, parallel=2,
                    objective="val_accuracy", config=TrainConfig(workers=1, ui="none"))
    trials = [study.ask() for _ in range(2)]
    for trial in trials:
        row = search.state.trial_started(trial.number, {}, epochs=1)
        job = types.SimpleNamespace(status="done", history={"val_accuracy": [0.9]}, model=object(),
                                    state=types.SimpleNamespace(workers=[]))
        search.jobs[trial.number] = job
        search.running[trial.number] = TrialRun(trial=trial, job=job, row=row, slot=trial.number)
    for number in order:
        search._finish(number)
    search._end()
    best = study.best_trial.number
    assert search.best_model is search.jobs[best].model and search.best_number == best
    assert search.state.best_number == best


def test_a_search_without_trials_runs_the_default_number_and_says_so_first(tmp_path, caplog):
    """``%%dist_tune`` with no --trials (argparse refused it before): the study's goal is DEFAULT_TRIALS (10), and
    the first line logged says so and how to choose."""
    pytest.importorskip("optuna")
    from IPython.core.magic_arguments import parse_argstring

    from nbdist.magics.tune import TuneMagics
    from nbdist.search.entry import make_search
    from nbdist.search.study import DEFAULT_TRIALS

    assert parse_argstring(TuneMagics.dist_tune, "--objective val_accuracy").trials is None
    with caplog.at_level("WARNING", logger="nbdist.search"):
        search = make_search(lambda trial: None, parallel=1, objective="val_loss", backend="containers",
                             storage=f"sqlite:///{tmp_path / 'study.db'}", models_dir=False)
    assert DEFAULT_TRIALS == 10 and search.state.n_trials == 10
    assert caplog.records[0].getMessage().startswith("no --trials given: the study runs until it has 10 finished")
