"""The worker's command line and environment (backends/command.py), built once for every backend.

``python -m nbdist.worker`` and its flags are an interface (fork servers, warm workers and users' container
images start it): each command line is pinned here to the letter and parsed by the worker's
own parser; the thread budget reaches local, Spark and container workers alike.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import nbdist
from nbdist.backends.command import (
    STARTUP_KEYS,
    container_env,
    fork_server_command,
    job_command,
    package_root,
    thread_env,
    warm_socket_command,
    worker_env,
)
from nbdist.backends.containers import Engine, cpuset_available, run_command
from nbdist.config import TrainConfig
from nbdist.machine.processes import read_log_tail
from nbdist.worker.main import _parse

THREADS = {"OMP_NUM_THREADS": "3", "TF_NUM_INTRAOP_THREADS": "3", "TF_NUM_INTEROP_THREADS": "2"}


def test_command_lines_are_the_workers_interface_to_the_letter():
    assert job_command(("10.0.0.5", 4242), 1, die_with_parent=True, python="/py") == [
        "/py", "-m", "nbdist.worker", "--address", "10.0.0.5:4242", "--rank", "1", "--die-with-parent"]
    assert job_command(("h", 5), 0, python="/py") == ["/py", "-m", "nbdist.worker", "--address", "h:5",
                                                      "--rank", "0"]
    assert fork_server_command("/py") == ["/py", "-m", "nbdist.worker", "--fork-server"]
    assert warm_socket_command("/d/k-t.sock", (77, 1234), "/py") == [
        "/py", "-m", "nbdist.worker", "--warm-socket", "/d/k-t.sock", "--watch", "77:1234"]
    assert job_command(("h", 5), 0)[0] == fork_server_command()[0] == sys.executable


def test_the_worker_parses_every_command_line_built_for_it():
    cold = _parse(job_command(("h", 5), 3, die_with_parent=True)[3:])
    assert (cold.address, cold.rank, cold.die_with_parent, cold.fork_server) == ("h:5", 3, True, False)
    assert _parse(fork_server_command()[3:]).fork_server
    sock = _parse(warm_socket_command("/s.sock", (1, 2))[3:])
    assert (sock.warm_socket, sock.watch) == ("/s.sock", "1:2")


def test_a_local_workers_environment_is_the_notebooks_plus_nbdists_own():
    notebook = {"PATH": "/bin", "PYTHONPATH": "/mine", "MPLBACKEND": "inline", "TF_CPP_MIN_LOG_LEVEL": "0"}
    env = worker_env(3, notebook)
    assert env["PYTHONPATH"] == os.pathsep.join([package_root(), "/mine"])  # the driver's own nbdist first
    assert Path(package_root()) == Path(nbdist.__file__).resolve().parents[1]
    assert env["PATH"] == "/bin" and "MPLBACKEND" not in env  # the kernel's inline backend does not exist there
    assert env["TF_CPP_MIN_LOG_LEVEL"] == "0" and env["PYTHONUNBUFFERED"] == "1"
    assert {k: env[k] for k in THREADS} == THREADS
    assert env["CUDA_VISIBLE_DEVICES"] == ""  # no GPU unless the backend gives the worker one
    assert worker_env(1, {"CUDA_VISIBLE_DEVICES": "2"})["CUDA_VISIBLE_DEVICES"] == "2"
    assert worker_env(1, {})["TF_CPP_MIN_LOG_LEVEL"] == "2"
    # TensorFlow would map its whole GPU at once, leaving no room for the device sum's torch buckets.
    assert worker_env(1, {}, backend="tensorflow")["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert worker_env(1, {"TF_FORCE_GPU_ALLOW_GROWTH": "false"}, backend="tensorflow")[
        "TF_FORCE_GPU_ALLOW_GROWTH"] == "false"
    assert "TF_FORCE_GPU_ALLOW_GROWTH" not in worker_env(1, {}, backend="torch")
    assert notebook["PYTHONPATH"] == "/mine"  # the notebook's own environment is not touched


def test_a_container_gets_the_same_worker_variables_and_none_of_the_notebooks_others():
    env = container_env(3, mounted_package=True, gpus=False, environ={"SECRET_TOKEN": "x"})
    local = worker_env(3, {"SECRET_TOKEN": "x"})
    assert "SECRET_TOKEN" not in env and env["HOME"] == "/tmp" and env["PYTHONPATH"] == package_root()
    shared = set(thread_env(3)) | {"TF_CPP_MIN_LOG_LEVEL", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES"}
    assert {k: env[k] for k in shared} == {k: local[k] for k in shared}
    user_image = container_env(1, mounted_package=False, gpus=True, environ={})
    assert "PYTHONPATH" not in user_image and "CUDA_VISIBLE_DEVICES" not in user_image
    assert user_image["NBDIST_GPUS_ASKED"] == "1" and "NBDIST_GPUS_ASKED" not in env  # a worker with none says so


def test_the_container_command_line_ends_in_the_workers_own():
    cmd = run_command(Engine("docker", "/usr/bin/docker"), name="n", run_id="r", rank=2, image="img",
                      python="python", address=("127.0.0.1", 9), threads=2, mounts=[],
                      config=TrainConfig(backend="containers"))
    assert cmd[cmd.index("img"):] == ["img", *job_command(("127.0.0.1", 9), 2, python="python")]
    assert "--die-with-parent" not in cmd  # the engine client is the parent, not the notebook
    assert "OMP_NUM_THREADS=2" in cmd and "TF_NUM_INTEROP_THREADS=2" in cmd and "CUDA_VISIBLE_DEVICES=" in cmd
    assert "--cpuset-cpus" not in cmd
    pinned = run_command(Engine("podman", "/usr/bin/podman", cpuset=True), name="n", run_id="r", rank=1,
                         image="img", python="python", address=("127.0.0.1", 9), threads=2, mounts=[],
                         config=TrainConfig(backend="containers"), cores={3, 2})
    assert pinned[pinned.index("--cpuset-cpus") + 1] == "2,3" and pinned.index("--cpuset-cpus") < pinned.index("img")


@pytest.mark.parametrize("name, info, pinned", [
    ("podman", "host:\n  cgroupControllers:\n  - cpuset\n  - cpu\n  cgroupManager: systemd\n", True),
    ("podman", "host:\n  cgroupControllers:\n  - cpu\n  - memory\n  cgroupManager: systemd\n", False),  # rootless
    ("podman", "host:\n  cgroupControllers: []\n", False),
    ("docker", "Server:\n Cgroup Version: 2\n", True),
    ("docker", "Server:\nWARNING: No cpuset support\n", False),
])
def test_containers_are_pinned_to_cores_only_where_the_engine_has_the_cpuset_cgroup(name, info, pinned):
    assert cpuset_available(name, info) is pinned


def test_warm_worker_sockets_are_named_after_every_variable_the_worker_env_decides():
    decided = set(thread_env(1)) | {"PYTHONPATH", "CUDA_VISIBLE_DEVICES", "TF_CPP_MIN_LOG_LEVEL"}
    assert decided <= set(STARTUP_KEYS)


def test_a_log_tail_reads_the_last_lines_only(tmp_path):
    path = tmp_path / "worker.log"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(20000)) + b"bad \xff byte\n")
    assert read_log_tail(path, 2) == "line 19999\nbad \ufffd byte"
    assert read_log_tail(tmp_path / "missing.log") == ""
