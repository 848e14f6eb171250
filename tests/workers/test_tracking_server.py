"""Issue 27, tracking against a real MLflow tracking server: the test starts ``mlflow server`` (SQLite
backend store, artifacts under tmp_path, a free loopback port) and a ``%%dist_train`` cell on 2 real
workers with ``mlflow.keras.autolog()`` active is exactly one run on that server: its params, merged
per-epoch metrics equal to the History, and a model artifact that ``mlflow.keras.load_model`` loads
over HTTP and that predicts as the trained model."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("flask", reason="mlflow server needs the full mlflow package (the test extra), not mlflow-skinny")
pytestmark = pytest.mark.usefixtures("no_leftover_workers")

STARTUP_TIMEOUT = 120.0  # seconds for the server to answer /health (it is slow to import on a loaded machine)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def kill_group(proc: subprocess.Popen) -> None:
    """The server and every process it started (uvicorn, its job runner): its own process group."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        try:  # the leader is gone; its children may still be ending
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.5)


@pytest.fixture
def tracking_server(tmp_path: Path) -> Iterator[str]:
    """``mlflow server`` on 127.0.0.1 with an SQLite store and artifacts in tmp_path; killed afterwards, with
    the tracking URI and MLflow's global state put back."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("wb")
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no background job runner
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
         "--artifacts-destination", str(tmp_path / "artifacts")],
        cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail(f"mlflow server did not start: {(tmp_path / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        with _use_tracking_uri(url):
            try:
                yield url
            finally:
                while mlflow.active_run() is not None:
                    mlflow.end_run()
                mlflow.keras.autolog(disable=True)
    finally:
        kill_group(proc)
        log.close()


@pytest.mark.full("a %%dist_train cell under autolog as one MLflow run: test_tracking.py's autolog test")
def test_dist_train_with_autolog_is_one_run_on_a_tracking_server(ip, tracking_server, tmp_path):
    import mlflow.keras

    mlflow.keras.autolog()
    ip.run_cell_magic("dist_train", "--workers 2 --ui none --run-name served", """
import keras
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
served_history = model.fit(X, y, batch_size=64, epochs=2, validation_data=(Xv, yv), verbose=0)
""")
    client = mlflow.MlflowClient()
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1, [r.info.run_name for r in runs]  # one run: none per worker, none from autolog's fit
    run = runs[0]
    assert run.info.run_name == "served" and run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:")  # artifacts went through the server
    p = run.data.params
    assert (p["workers"], p["backend"], p["epochs"], p["fit.batch_size"]) == ("2", "local", "2", "64")
    history = ip.user_ns["served_history"].history
    for key in ("loss", "accuracy", "val_loss", "val_accuracy"):
        steps = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert [s for s, _ in steps] == [0, 1]
        np.testing.assert_allclose([v for _, v in steps], history[key], rtol=1e-6)
    assert list((tmp_path / "artifacts").rglob("*.keras")), "the model is stored under the server's artifacts"
    loaded = mlflow.keras.load_model(f"runs:/{run.info.run_id}/model")
    x = ip.user_ns["Xv"][:50]
    np.testing.assert_allclose(loaded.predict(x, verbose=0), ip.user_ns["model"].predict(x, verbose=0), atol=1e-6)
