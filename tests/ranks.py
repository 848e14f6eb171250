"""Run one function as W real processes (ranks) that meet over Gloo on loopback; collect their reports."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_ranks(target: str, world: int, *args: Any, timeout: float = 120,
              exits: dict[int, int] | None = None) -> list[dict[str, Any] | None]:
    """Call ``module:function(rank, world, port, *args)`` in ``world`` processes.

    Each process must print one JSON object as its last line; they are returned by rank.
    A rank that fails has its stderr shown in the assertion; ``exits``: ranks that must end with that
    status instead (their report is None).
    """
    module, func = target.split(":")
    code = (f"import sys, json; from {module} import {func}; "
            f"{func}(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), *json.loads(sys.argv[4]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "3"}
    for attempt in range(3):
        # A free port is picked, then let go for rank 0's store to bind: another process may take it in
        # between (CI saw errno 98 once). Then the group starts again on a new port.
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(world), str(port),
                                   json.dumps(list(args))],
                                  cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for r in range(world)]
        try:
            outs = [procs[0].communicate(timeout=timeout)]
            if procs[0].returncode != 0 and "errno: 98" in outs[0][1] and attempt < 2:
                continue  # the finally below stops the other ranks
            outs += [p.communicate(timeout=timeout) for p in procs[1:]]
            break
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=10)
    reports: list[dict[str, Any] | None] = []
    for rank, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == (exits or {}).get(rank, 0), err[-2000:]
        reports.append(None if rank in (exits or {}) else json.loads(out.strip().splitlines()[-1]))
    return reports
