"""The worker program's command line and environment, built once for every way a worker starts.

``python -m nbdist.worker`` and its flags are an interface: warm workers and users' container
images start it, so they change only together with the worker's parser (worker/main.py). The
run's secret is never here: it goes on the worker's stdin or socket (wire/secret.py).

Runs on Spark executors too (spark/task.py, spark/warm.py), so it imports no third-party package.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from ..machine.keras_backend import ENV as BACKEND_ENV
from ..machine.keras_backend import notebook_backend
from ..machine.placement import GPUS_ASKED, interop_threads

WORKER_MODULE = "nbdist.worker"
# The variables a worker's start depends on: two environments that agree on these can share a
# warm worker (spark/warm.py names its sockets after them; the order keeps those names stable).
# KERAS_BACKEND: a warm worker has imported its Keras backend, so it serves only runs on that backend.
STARTUP_KEYS = ("PYTHONPATH", "OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS",
                "CUDA_VISIBLE_DEVICES", "TF_CPP_MIN_LOG_LEVEL", BACKEND_ENV, "NBDIST_WARM_IMPORTS")
# Variables of these families may be read while TensorFlow, torch, Keras or the interpreter load:
# a local fork server (backends/warm.py) is shared only by environments that agree on all of them.
# The rest (PYTEST_CURRENT_TEST, a notebook's own settings) reach each forked worker with its job.
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "TF_", "XLA_", "CUDA", "NVIDIA", "KERAS", "JAX", "TORCH",
                    "LD_", "MALLOC", "GLIBC")


def package_root() -> str:
    """The directory holding the nbdist package, so workers import the driver's own copy."""
    return str(Path(__file__).resolve().parents[2])


# -- command lines ---------------------------------------------------------------
def _worker(python: str) -> list[str]:
    return [python, "-m", WORKER_MODULE]


def job_command(address: tuple[str, int], rank: int, *, die_with_parent: bool = False,
                python: str = sys.executable) -> list[str]:
    """A cold worker for one job: it connects to the coordinator at ``address`` as ``rank``.

    ``die_with_parent``: the worker dies with the process that starts it (not for containers,
    whose engine client is the parent, nor for warm workers; see backends/warm.py).
    """
    cmd = [*_worker(python), "--address", f"{address[0]}:{address[1]}", "--rank", str(rank)]
    return [*cmd, "--die-with-parent"] if die_with_parent else cmd


def fork_server_command(python: str = sys.executable) -> list[str]:
    """The local fork server: imports first, then forks a worker for each job read on stdin
    (backends/warm.py, worker/fork_server.py)."""
    return [*_worker(python), "--fork-server"]


def warm_socket_command(sock_path: str, executor: tuple[int, int], python: str = sys.executable) -> list[str]:
    """A warm worker on a Spark executor: imports, then waits on ``sock_path`` while ``executor``
    (pid, start time) lives (spark/warm.py)."""
    return [*_worker(python), "--warm-socket", sock_path, "--watch", f"{executor[0]}:{executor[1]}"]


# -- environment -----------------------------------------------------------------
def startup_env(env: Mapping[str, str]) -> dict[str, str]:
    """The part of a worker's environment its imports may read: what a fork server must agree on."""
    return {k: v for k, v in env.items() if k in STARTUP_KEYS or k.startswith(STARTUP_PREFIXES)}


def thread_env(threads: int) -> dict[str, str]:
    """The thread budget as the variables OpenMP and TensorFlow read when they start."""
    return {"OMP_NUM_THREADS": str(threads), "TF_NUM_INTRAOP_THREADS": str(threads),
            "TF_NUM_INTEROP_THREADS": str(interop_threads(threads))}


def _worker_variables(threads: int, environ: Mapping[str, str], backend: str | None) -> dict[str, str]:
    """What every worker gets wherever it runs: the notebook's Keras backend (read before the worker
    imports Keras, whatever its own environment or keras.json says), unbuffered output, TensorFlow's
    C++ logs quiet unless the notebook set a level, and its thread budget. On TensorFlow, GPU memory
    grows as needed unless the notebook says otherwise: by default TensorFlow maps nearly all of its GPU
    at once, and the device sum's torch buckets and NCCL's buffers live beside it (strategies/device_sum.py)."""
    name = backend or notebook_backend(environ)
    growth = {"TF_FORCE_GPU_ALLOW_GROWTH": environ.get("TF_FORCE_GPU_ALLOW_GROWTH", "true")} if (
        name == "tensorflow") else {}
    # XLA's CPU client (JAX's) sizes its thread pool by NPROC, else by the cores the process may use. With one
    # core the gradient sum's host callback waited forever: JAX's io_callback copies its operands through that
    # pool, whose one thread runs the very step calling back. At least two threads, whatever the budget.
    pool = {"NPROC": environ.get("NPROC") or str(max(2, threads))} if name == "jax" else {}
    return {BACKEND_ENV: name, "TF_CPP_MIN_LOG_LEVEL": environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
            **thread_env(threads), "PYTHONUNBUFFERED": "1", **growth, **pool}


def worker_env(threads: int, environ: Mapping[str, str] | None = None, backend: str | None = None) -> dict[str, str]:
    """The whole environment of a worker process on this machine: the notebook's, plus nbdist's own.

    ``backend``: the notebook's Keras backend (a Spark task, which runs elsewhere, is told it); by
    default this process's (keras_backend.notebook_backend)."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root(), env.get("PYTHONPATH", "")) if p)
    env.update(_worker_variables(threads, env, backend))
    env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "")  # the backend sets a GPU per worker
    env.pop("MPLBACKEND", None)  # the kernel's inline backend does not exist in a worker
    return env


def container_env(threads: int, *, mounted_package: bool, gpus: bool,
                  environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a worker container is given (the image has its own environment otherwise).

    ``mounted_package``: nbdist is mounted from the host at its own path (the default image);
    ``gpus``: GPUs are passed through, so the worker may see them.
    """
    env = {**_worker_variables(threads, os.environ if environ is None else environ, None), "HOME": "/tmp"}
    if mounted_package:
        env["PYTHONPATH"] = package_root()
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env[GPUS_ASKED] = "1"  # a worker that sees none says so (placement.gpu_missing_notice)
    return env
