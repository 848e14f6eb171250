"""Loopback TCP bandwidth: one stream between two processes on 127.0.0.1, for P4's context.

An allreduce between 2 ranks on one machine cannot move bytes faster than this.

    python benchmarks/loopback.py [--mib 256]
"""
from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

CHUNK = 4 * 2**20


def _send(port: int, nbytes: int) -> None:
    buf = memoryview(bytes(CHUNK))  # slicing a memoryview copies nothing
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        sent = 0
        while sent < nbytes:
            s.sendall(buf[: min(CHUNK, nbytes - sent)])
            sent += min(CHUNK, nbytes - sent)


def tcp_bandwidth(mib: int = 256) -> float:
    """GB/s of one loopback TCP stream from a child process to this one."""
    nbytes = mib * 2**20
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(60)
        port = srv.getsockname()[1]
        child = subprocess.Popen([sys.executable, __file__, "--send", str(port), "--mib", str(mib)])
        try:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(60)
                view = memoryview(bytearray(CHUNK))
                got, t0 = 0, None
                while got < nbytes:
                    n = conn.recv_into(view)
                    if n == 0:
                        raise RuntimeError("the sender closed early")
                    if t0 is None:
                        t0 = time.perf_counter()  # from the first byte: connection set-up excluded
                    got += n
                seconds = time.perf_counter() - t0
        finally:
            child.wait(timeout=60)
    return nbytes / seconds / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--send", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--mib", type=int, default=256)
    args = p.parse_args()
    if args.send is not None:
        _send(args.send, args.mib * 2**20)
        return
    print(f"loopback TCP, one stream: {tcp_bandwidth(args.mib):.2f} GB/s")


if __name__ == "__main__":
    main()
