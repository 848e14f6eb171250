"""Worker processes and their inputs: each local worker pinned to its own cores, a shard held once.

The pipeline's logic is tested in-process in tests/unit/test_worker_inputs.py.
"""
from __future__ import annotations

import numpy as np
import pytest


@pytest.mark.skipif(len(getattr(__import__("os"), "sched_getaffinity", lambda _: ())(0)) < 2, reason="needs 2 cores")
def test_local_backend_pins_each_worker_to_its_own_core():
    import os
    import socket

    from nbdist.backends.local import LocalBackend

    before = os.sched_getaffinity(0)
    cores = sorted(before)[:2]
    backends = [LocalBackend(), LocalBackend()]
    # A coordinator that accepts and never answers: the workers start and wait, which is all we look at.
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()
    try:
        os.sched_setaffinity(0, cores)  # the driver's usable cores: the workers split them
        workers = backends[0].launch(2, address, b"x" * 32, 1)
        assert [os.sched_getaffinity(w.proc.pid) for w in workers] == [{cores[0]}, {cores[1]}]
        workers = backends[1].launch(3, address, b"x" * 32, 1)  # more workers than cores
        assert all(os.sched_getaffinity(w.proc.pid) == set(cores) for w in workers)
    finally:
        listener.close()
        os.sched_setaffinity(0, before)
        for backend in backends:
            backend.stop(grace=1.0)
            backend.cleanup()


def _worker_rss_mib(rows: int) -> float:
    """A 2-worker run's worker RSS (MiB, the larger of the two) at the end of its first epoch."""
    import keras
    import psutil

    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    x = np.random.default_rng(0).random((rows, 500), dtype=np.float32)
    y = (x[:, 0] > 0.5).astype("int64")
    model = keras.Sequential([keras.Input((500,)), keras.layers.Dense(8, activation="relu"),
                              keras.layers.Dense(2, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    seen: list[float] = []

    def on_event(kind, state, payload):
        if kind == "epoch" and not seen:
            seen.append(max(psutil.Process(w.pid).memory_info().rss for w in state.workers) / 2**20)

    job = prepare(model, TrainConfig(epochs=1, batch_size=1024, workers=2, ui="none"), x, y, None,
                  listeners=[on_event])
    job.start()
    job.wait()
    return seen[0]


def test_a_worker_holds_its_shard_once(no_leftover_workers):
    # 200,000 x 500 float32 = 381 MiB, 191 MiB per worker. Keeping the received numpy arrays next
    # to the pipeline's copy, and letting tf.data copy a captured tensor once more, made a
    # worker hold its shard 3.1 times (measured); now once, plus the labels.
    shard_mib = 200_000 * 500 * 4 / 2 / 2**20
    grown = _worker_rss_mib(200_000) - _worker_rss_mib(2_000)
    assert grown < 1.5 * shard_mib, f"a worker grew by {grown:.0f} MiB for a {shard_mib:.0f} MiB shard"


def test_a_worker_starts_without_tensorflows_load_time_noise():
    """A worker's log holds its own lines, not TensorFlow's oneDNN / CUDA-probing / absl notices."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}  # as on a Spark executor
    # The fork server imports TensorFlow and torch, refuses a malformed request in one line, and exits
    # when its stdin closes.
    done = subprocess.run([sys.executable, "-m", "nbdist.worker", "--fork-server"], input=b"not a job\n",
                          capture_output=True, env=env, timeout=300)
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 0 and "refused a request: malformed request" in err, err
    assert "Traceback" not in err and done.stdout.startswith(b'{"refused"'), err
    for noise in ("absl::InitializeLog", "oneDNN", "cuda drivers", "port.cc", "cudart_stub"):
        assert noise not in err, err
    if not os.path.exists("/proc/driver/nvidia"):
        assert "cuInit" not in err, err


def test_a_worker_imports_keras_without_the_packages_it_never_uses(digits, no_leftover_workers):
    """TensorFlow and Keras import jax, pandas (and pyarrow) and scikit-learn whenever they are installed
    (TF Lite's JAX conversion, Keras' pandas slicing and sklearn wrappers): ~300 MB of a worker's 1.2 GB.
    Installed here, yet a TensorFlow worker has none of them."""
    import importlib.util

    import keras

    import nbdist
    from nbdist.machine.keras_backend import OPTIONAL_AT_IMPORT

    if keras.backend.backend() != "tensorflow":
        pytest.skip("the TensorFlow backend's workers")
    installed = [m for m in OPTIONAL_AT_IMPORT if importlib.util.find_spec(m) is not None]
    if not installed:
        pytest.skip("none of the optional packages is installed: nothing to leave out")
    x, y = digits
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    # Forked from the warm fork server (the tests' default); a cold worker and a Spark task's run the same
    # __main__, which imports Keras this way before anything else.
    job = nbdist.train(model, x[:256], y[:256], epochs=1, batch_size=64, workers=2, backend="local", ui="none")
    loaded = {r: report["optional_imports"] for r, report in job.reports.items()}
    assert loaded == {0: [], 1: []}, (installed, loaded)


_CLOSED_LINK = """
import time
from tests.unit.test_protocol import pair
from nbdist.wire import protocol
from nbdist.worker.main import DriverLink

secret = protocol.new_secret()
driver, worker = pair(secret, secret)
link = DriverLink(worker, heartbeat_interval=0.5, heartbeat_timeout=0.5)
worker.closed = True  # closed by its owner, as a worker ends its job
driver.close()
worker.close()
time.sleep(2.0)  # four heartbeats' time of silence
print("alive")
"""


def test_a_closed_driver_link_never_ends_its_process_for_silence():
    """A DriverLink whose channel its owner closed stops beating; it does not take the driver's silence since the
    close for a lost driver and ``os._exit(4)`` the process (which once ended pytest itself, from a unit test's
    link, a minute after that test). A process of its own, since the old behaviour ends the process."""
    import os
    import subprocess
    import sys

    from nbdist.backends.command import package_root

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root(), os.getcwd()])}
    done = subprocess.run([sys.executable, "-c", _CLOSED_LINK], env=env, capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0 and "alive" in done.stdout, (done.returncode, done.stderr[-2000:])
