"""`python -m nbdist.worker`: import TensorFlow quietly (on its backend only), then run the worker (main.py).

TensorFlow's native libraries log at load time, before absl's logging is initialised, so
TF_CPP_MIN_LOG_LEVEL does not reach those lines: oneDNN's notice, "Could not find cuda
drivers" and, on a machine with no NVIDIA driver, a failed cuInit. They land in every
worker's log and in the tail shown when a worker fails. ``quiet_tensorflow_import`` drops
exactly those lines while TensorFlow loads; everything else, errors included, passes.
``scripts/run_notebook.py`` (``make demo``) calls it in its kernel too.
"""
from __future__ import annotations

import os
import re
import sys
import threading

# TensorFlow's INFO and WARNING lines once absl's logging is up; the user's own setting wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

_LOAD_NOISE = re.compile(
    rb"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    rb"|[IW]\d{4} [\d:. ]+\d+ [\w./]+\.cc:\d+\] .*"  # absl INFO and WARNING lines, printed before init
)
# Only where no NVIDIA driver is loaded: there a failed cuInit means "no GPU", not a fault.
_NO_GPU_NOISE = re.compile(rb"E\d{4} [\d:. ]+\d+ cuda_\w+\.cc:\d+\] failed call to cuInit: .*")


def _forward(read_fd: int, write_fd: int, noise: list[re.Pattern[bytes]]) -> None:
    """Copies lines from ``read_fd`` to ``write_fd`` until EOF, leaving out ``noise``."""
    pending = b""
    while chunk := os.read(read_fd, 65536):
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if not any(p.fullmatch(line.rstrip(b"\r")) for p in noise):
                os.write(write_fd, line + b"\n")
    if pending:
        os.write(write_fd, pending)
    os.close(read_fd)


def quiet_tensorflow_import() -> None:
    """Imports TensorFlow with its load-time log lines filtered out of file descriptor 2.

    Without an NVIDIA driver it also lists the (absent) GPUs inside the filter, where cuInit's
    failure is logged. With one it does not: a warm worker learns CUDA_VISIBLE_DEVICES only
    with its job, and cuInit reads it once. TF_CPP_MIN_LOG_LEVEL below 2 turns the filter off.
    """
    level = os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0")
    if "tensorflow" in sys.modules or not level.isdigit() or int(level) < 2:
        return
    no_driver = not os.path.exists("/proc/driver/nvidia")
    noise = [_LOAD_NOISE] + ([_NO_GPU_NOISE] if no_driver else [])
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    real_stderr = os.dup(2)
    os.dup2(write_fd, 2)
    os.close(write_fd)
    forwarder = threading.Thread(target=_forward, args=(read_fd, real_stderr, noise), name="nbdist-quiet-tf",
                                 daemon=True)
    forwarder.start()
    try:
        import tensorflow as tf

        if no_driver:
            tf.config.list_physical_devices("GPU")
    finally:
        sys.stderr.flush()
        os.dup2(real_stderr, 2)  # the pipe's last writer closes: the forwarder drains it and ends
        forwarder.join(timeout=10)
        if not forwarder.is_alive():  # else a child holds the pipe: the forwarder keeps writing to it
            os.close(real_stderr)


if __name__ == "__main__":
    from ..machine.keras_backend import configured_backend, optional_packages_hidden

    if "--warm-socket" in sys.argv[1:-1]:  # a warm worker on a Spark executor: claimable while it imports
        from .warm_socket import bind_early

        bind_early(sys.argv[sys.argv.index("--warm-socket") + 1])

    # KERAS_BACKEND is the notebook's (backends/command.py): a JAX or torch worker never loads TensorFlow.
    # A fork server on a machine with GPUs imports nothing that picks a device (placement.warm_server_env).
    if configured_backend() == "tensorflow" and os.environ.get("NBDIST_WARM_IMPORTS") != "device-free":
        with optional_packages_hidden("tensorflow"):  # and Keras with it: both try jax, pandas, sklearn
            quiet_tensorflow_import()
            import keras  # noqa: F401
    from .main import main

    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: TensorFlow's and Gloo's native threads can abort
    # while Python unloads modules, turning a clean finish into a crash report.
    os._exit(code)
