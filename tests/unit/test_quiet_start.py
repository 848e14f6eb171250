"""The worker's start-up filter (nbdist/worker/__main__.py) drops TensorFlow's load-time lines and nothing else."""
from __future__ import annotations

import os
import threading

from nbdist.worker.__main__ import _LOAD_NOISE, _NO_GPU_NOISE, _forward

TF_LOAD_LINES = [
    b"WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    b"I0000 00:00:1795459233.159345   27411 port.cc:153] oneDNN custom operations are on. You may see slightly "
    b"different numerical results due to floating-point round-off errors from different computation orders.",
    b"I0000 00:00:1795459233.160333   27411 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
    b"GPU will not be used.",
]
CUINIT = (b"E0000 00:00:1795459271.655550   27411 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: "
          b"Failed call to cuInit: UNKNOWN ERROR (303)")
REAL = [
    b"E0000 00:00:1795459271.655550   27411 op_kernel.cc:1830] OP_REQUIRES failed: out of memory",
    b"F0000 00:00:1795459271.655550   27411 check.cc:12] Check failed: x == y",
    b"Traceback (most recent call last):",
    b"ValueError: I0000 is not a number",
    b"",
]


def filtered(lines: list[bytes], noise, tail: bytes = b"") -> bytes:
    """What ``_forward`` passes on for ``lines`` written in small, line-splitting chunks."""
    data = b"".join(line + b"\n" for line in lines) + tail
    src_r, src_w = os.pipe()
    dst_r, dst_w = os.pipe()
    thread = threading.Thread(target=_forward, args=(src_r, dst_w, noise))
    thread.start()
    for i in range(0, len(data), 7):  # lines arrive cut anywhere, as from a pipe
        os.write(src_w, data[i:i + 7])
    os.close(src_w)
    thread.join(5)
    os.close(dst_w)
    with os.fdopen(dst_r, "rb") as out:
        return out.read()


def test_tensorflow_load_lines_are_dropped_and_everything_else_passes_in_order():
    lines = [TF_LOAD_LINES[0], REAL[0], TF_LOAD_LINES[1], REAL[1], TF_LOAD_LINES[2], REAL[2], REAL[3], REAL[4]]
    assert filtered(lines, [_LOAD_NOISE], tail=b"no newline yet") == (
        b"".join(line + b"\n" for line in REAL) + b"no newline yet")


def test_a_failed_cuinit_is_dropped_only_where_no_nvidia_driver_is_loaded():
    assert filtered([CUINIT, REAL[0]], [_LOAD_NOISE, _NO_GPU_NOISE]) == REAL[0] + b"\n"
    assert filtered([CUINIT], [_LOAD_NOISE]) == CUINIT + b"\n"  # with a driver it is a real fault
