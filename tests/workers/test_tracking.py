"""Issue 27, tracking: every training run is ONE MLflow run logged from the notebook (real SQLite
tracking store, real worker processes, digits): params, merged per-epoch metrics with step = epoch,
the trained model as a Keras artifact, the summary chart; nested under (or logged into) the
notebook's active run; a server that is down costs one warning; nothing when MLflow is absent."""
from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Iterator

import numpy as np
import pytest
from IPython.core.error import UsageError

from ..conftest import mlp

mlflow = pytest.importorskip("mlflow")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")


@pytest.fixture
def store(tmp_path) -> Iterator[str]:
    """A fresh SQLite tracking store for the test; MLflow's global state put back afterwards."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with _use_tracking_uri(uri):
        try:
            yield uri
        finally:
            while mlflow.active_run() is not None:
                mlflow.end_run()
            mlflow.autolog(disable=True)
            mlflow.keras.autolog(disable=True)


def all_runs() -> list:
    client = mlflow.MlflowClient()
    ids = [e.experiment_id for e in client.search_experiments()]
    return client.search_runs(ids)


def metric_series(run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in mlflow.MlflowClient().get_metric_history(run_id, key))


def test_dist_train_cell_fit_with_autolog_is_one_run_with_params_metrics_and_model(ip, store):
    """With mlflow.keras.autolog() active, a %%dist_train cell whose own model.fit trains 2 epochs on 2
    workers is exactly one MLflow run (no run per worker, none from the patched fit): its params,
    the merged metrics per epoch equal to the History, a loadable Keras model predicting as the
    trained one, and the dashboard's chart."""
    import mlflow.keras

    mlflow.keras.autolog()
    ip.run_cell_magic("dist_train", "--workers 2 --ui none --run-name cell-fit", """
import keras
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
fit_history = model.fit(X, y, batch_size=64, epochs=2, validation_data=(Xv, yv), verbose=0)
""")
    runs = all_runs()
    assert len(runs) == 1, [r.info.run_name for r in runs]
    run = runs[0]
    assert run.info.run_name == "cell-fit" and run.info.status == "FINISHED"
    p = run.data.params
    assert (p["workers"], p["backend"], p["strategy"], p["epochs"]) == ("2", "local", "allreduce", "2")
    assert p["fit.batch_size"] == "64" and p["optimizer"] == "Adam"
    assert float(p["optimizer.learning_rate"]) == pytest.approx(0.01)
    history = ip.user_ns["fit_history"].history
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        steps = metric_series(run.info.run_id, key)
        assert [s for s, _ in steps] == [0, 1]
        np.testing.assert_allclose([v for _, v in steps], history[key], rtol=1e-6)
    files = {f.path for f in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"model", "nbdist_summary.png"} <= files
    loaded = mlflow.keras.load_model(f"runs:/{run.info.run_id}/model")
    # Its requirements name Keras and TensorFlow at the notebook's versions (given, not inferred by MLflow
    # in a child process that loads the model again).
    from importlib.metadata import version

    needs = mlflow.pyfunc.get_model_dependencies(f"runs:/{run.info.run_id}/model")
    with open(needs) as f:
        pinned = set(f.read().split())
    assert {f"keras=={version('keras')}", f"tensorflow=={version('tensorflow')}"} <= pinned, pinned
    x = ip.user_ns["Xv"][:50]
    np.testing.assert_allclose(loaded.predict(x, verbose=0), ip.user_ns["model"].predict(x, verbose=0), atol=1e-6)


def test_api_run_nests_under_the_active_run_or_logs_into_it(digits, store):
    """nbdist.train with a run active in the notebook: a child of it by default (the active run stays
    active and unfinished), or that run itself with mlflow_active="use"."""
    import nbdist

    x, y = digits
    with mlflow.start_run(run_name="parent") as parent:
        job = nbdist.train(mlp(), x[:400], y[:400], epochs=2, batch_size=32, workers=2, run_name="child")
        nbdist.train(mlp(1), x[:400], y[:400], epochs=1, workers=2, mlflow_active="use")
        assert mlflow.active_run().info.run_id == parent.info.run_id
    runs = {r.info.run_name: r for r in all_runs()}
    assert set(runs) == {"parent", "child"}
    child = runs["child"]
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert [v for _, v in metric_series(child.info.run_id, "loss")] == pytest.approx(job.history["loss"])
    assert len(metric_series(parent.info.run_id, "loss")) == 1  # the run logged into the parent: one epoch
    assert runs["parent"].data.params["epochs"] == "1"


def test_an_elastic_run_logs_its_range_and_each_change_of_workers_as_a_tag(store):
    """The tracker fed an elastic run's events in-process (no workers; the real run's tag is checked in
    tests/workers/test_elastic.py): workers MIN:MAX, one tag per change, one metric step per epoch."""
    from nbdist.driver.state import MembershipChange, RunState
    from nbdist.ui.tracking import RunTracker
    from nbdist.wire.reports import Epoch

    st = RunState(world_size=3, epochs=2, strategy="allreduce", min_workers=2)
    tracker = RunTracker({}, run_name="elastic", log_model=False)
    tracker("start", st, None)

    def epoch(e, ranks):
        for r in ranks:
            merged = st.worker_epoch(r, Epoch(epoch=e, batch=4, batches=4, samples=100, val_samples=0, seconds=0.1,
                                              compute_seconds=0.1, sync_seconds=0.0, logs={"loss": 1.0 / (e + 1)}))
        tracker("epoch", st, merged)

    epoch(0, range(3))
    st.workers_left({1}, 2)
    change = MembershipChange(generation=1, left=[1], why="was killed by SIGKILL", workers=[0, 2], committed=1,
                              steps_lost=3)
    st.regrouped(change)
    tracker("membership", st, change)
    epoch(1, (0, 2))
    st.finish("done")
    tracker("end", st, None)

    assert not tracker.off
    (run,) = all_runs()
    assert run.data.params["workers"] == "2:3"
    assert run.data.tags["nbdist.membership.0"] == change.line
    assert "worker 1 left (was killed by SIGKILL)" in change.line
    assert metric_series(run.info.run_id, "loss") == [(0, 1.0), (1, 0.5)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tracking_server_down_costs_one_warning_and_mlflow_absent_logs_nothing(digits, store, caplog,
                                                                               monkeypatch):
    import nbdist

    x, y = digits
    mlflow.set_tracking_uri(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    with caplog.at_level(logging.WARNING, logger="nbdist"):
        job = nbdist.train(mlp(), x[:400], y[:400], epochs=2, workers=2)
    assert len(job.history["loss"]) == 2 and job.status == "done"
    warnings = [r for r in caplog.records if r.name == "nbdist.ui.tracking"]
    assert len(warnings) == 1 and "unreachable" in warnings[0].getMessage()

    # MLflow not installed (the import fails), though the environment names a tracking store.
    from nbdist.ui.tracking import import_mlflow, wanted

    monkeypatch.setitem(sys.modules, "mlflow", None)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    assert not wanted(None)
    with pytest.raises(nbdist.NbdistError, match=r"pip install 'nbdist\[track\]'"):
        import_mlflow(required=True)
    job = nbdist.train(mlp(), x[:400], y[:400], epochs=1, workers=2)
    assert job.status == "done" and not [ls for ls in job.listeners if type(ls).__name__ == "RunTracker"]


def test_mlflow_option_without_mlflow_is_one_sentence_before_the_cell_runs(ip, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)
    ip.user_ns.pop("ran", None)
    with pytest.raises(UsageError, match=r"--mlflow needs MLflow, which is not installed; pip install"):
        ip.run_cell_magic("dist_train", "--data X,y --mlflow --ui none", "ran = True\n")
    assert "ran" not in ip.user_ns
