"""A closed coordinator leaves no listening port and no accept thread behind.

Found by the soak loops: ``close()`` on a socket does not wake a thread blocked in
``accept()``, so every finished run kept its port open (still answering handshakes) and a
thread alive, for the life of the kernel.
"""
from __future__ import annotations

import socket
import threading
import time

import pytest

from nbdist.driver.coordinator import Coordinator


def accept_threads() -> int:
    return sum(t.name == "nbdist-accept" and t.is_alive() for t in threading.enumerate())


def test_close_ends_the_accept_thread_and_the_port():
    before = accept_threads()
    coordinators = [Coordinator(b"k" * 32, 2) for _ in range(5)]
    address = coordinators[0].address
    assert accept_threads() == before + 5
    for c in coordinators:
        c.close()
    deadline = time.monotonic() + 5
    while accept_threads() > before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert accept_threads() == before
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=2).close()
