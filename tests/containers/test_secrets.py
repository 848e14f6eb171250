"""The per-run secret never shows in `ps` (command lines, environments) nor in `podman inspect`.

Each backend hands the secret to its worker on stdin (backends/secret.py). These tests
look, while a real run is in progress, at every process on the machine and at the
container engine's own description of the worker containers.
"""
from __future__ import annotations

import io
import subprocess
import threading

import psutil
import pytest

from nbdist.api import prepare
from nbdist.config import TrainConfig
from nbdist.errors import NbdistError
from nbdist.worker.main import read_secret

from ..conftest import mlp, wait_no_workers


def test_worker_reads_one_hex_line_from_stdin():
    assert read_secret(io.BytesIO(b"00ff10\nrest")) == b"\x00\xff\x10"
    assert read_secret(io.BytesIO(b"")) is None  # the driver died before handing it over
    assert read_secret(io.BytesIO(b"not hex\n")) is None
    assert read_secret(io.BytesIO(b"\xff\xfe\n")) is None


def processes_showing(secret_hex: str) -> list[str]:
    """Every process on the machine whose command line or (readable) environment holds the secret."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if secret_hex in " ".join(proc.info["cmdline"] or []):
                found.append(f"pid {proc.pid} command line")
            if any(secret_hex in v for v in proc.environ().values()):
                found.append(f"pid {proc.pid} environment")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def run_and_look(digits, backend: str, look) -> None:
    """Start a real run, call ``look(job, secret_hex)`` once every worker trains, then finish it."""
    x, y = digits
    underway = threading.Event()

    def listener(kind, state, payload):
        if kind == "progress" and all(w.state == "training" for w in state.workers):
            underway.set()

    job = prepare(mlp(seed=0), TrainConfig(epochs=200, workers=2, backend=backend, ui="none"), x, y, None,
                  listeners=[listener])
    job.start()
    job.run_in_background()
    try:
        assert underway.wait(300), "training never started"
        look(job, job._coordinator.secret.hex())
    finally:
        job.stop("test over")
    assert job.status == "stopped"


def test_local_workers_secret_not_in_ps(digits):
    def look(job, secret_hex):
        assert len(job._handles) == 2
        assert processes_showing(secret_hex) == []

    run_and_look(digits, "local", look)
    assert not wait_no_workers(5)


def test_containers_secret_not_in_podman_inspect_or_ps(digits):
    from nbdist.backends.containers import find_engine

    try:
        engine = find_engine()
    except NbdistError as exc:
        pytest.skip(str(exc))

    def look(job, secret_hex):
        names = [h.name for h in job._handles]
        out = subprocess.run([engine.path, "inspect", *names], capture_output=True, timeout=60, check=True)
        assert names[0].encode() in out.stdout  # the inspection really describes our containers
        assert secret_hex.encode() not in out.stdout
        assert processes_showing(secret_hex) == []

    run_and_look(digits, "containers", look)
