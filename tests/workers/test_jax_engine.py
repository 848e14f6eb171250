"""``--engine jax`` (issue 36): on Keras' JAX backend the gradients summed by JAX's own collectives inside the
jitted step (Gloo on the CPU here, NCCL inside XLA on GPUs: the same code path). Real worker processes, digits.

The notebook runs in a process of its own (``jax_engine_driver.py``: Keras reads KERAS_BACKEND once); this
module checks what it prints. JAX's CPU collectives have had wrong sums and hangs (DESIGN.md 9): the sums
are checked against the local fit on the global batch, and a killed worker must fail the run at once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nbdist.backends.command import package_root

from .test_backends import assert_same_history

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

DRIVER = Path(__file__).with_name("jax_engine_driver.py")


@pytest.mark.timeout(400)
def test_two_jax_workers_sum_inside_the_step_as_the_local_fit_and_a_killed_one_fails_the_run():
    """SGD and Adam equal the local fit on the global batch; a BatchNorm and Dropout model equals the same run
    through the host call; uneven shares fall back to the host path in one sentence; the averaging strategy's
    rounds inside the JAX job equal the local step (every step, SGD) and the host's rounds (every 3 steps, uneven
    shares, BatchNorm and Dropout); a SIGKILLed worker fails the run at once (no hang in the collective)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root(), os.environ.get("PYTHONPATH"))
                                                       if p)}
    env.pop("KERAS_BACKEND", None)
    done = subprocess.run([sys.executable, str(DRIVER)], env=env, capture_output=True, text=True, timeout=360)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("NBDIST-RESULT ")]
    assert done.returncode == 0 and lines, f"driver failed ({done.returncode}):\n{done.stderr[-4000:]}"
    result = json.loads(lines[-1].removeprefix("NBDIST-RESULT "))
    for name in ("sgd", "adam"):
        run = result[name]
        assert run["engines"] == ["jax", "jax"] and run["summed_by"] == ["device", "device"], run
        assert_same_history(run["history"], run["expected"])
        assert run["weight_gap"] < 1e-5, (name, run["weight_gap"])
    # BatchNorm and Dropout: JAX's collective trains what the host call trains (the GPUs' default, issue 36).
    assert result["bn_jax"]["engines"] == ["jax", "jax"] and result["bn_gloo"]["engines"] == ["gloo", "gloo"]
    assert_same_history(result["bn_jax"]["history"], result["bn_gloo"]["history"])
    assert result["bn_gap"] < 1e-6, result["bn_gap"]
    uneven = result["uneven"]  # shares of 188 and 187 rows: the host path, said once
    assert uneven["engines"] == ["gloo", "gloo"], uneven
    assert any(w.startswith("--engine jax needs the same rows per step") for w in uneven["warnings"]), uneven
    assert_same_history(uneven["history"], uneven["expected"])
    assert uneven["weight_gap"] < 1e-5, uneven["weight_gap"]
    # The averaging strategy's rounds on the devices (the GPUs' path, over Gloo here).
    average = result["average"]
    assert average["summed_by"] == ["device", "device"], average
    assert_same_history(average["history"], average["expected"])
    assert average["weight_gap"] < 1e-5, average["weight_gap"]
    uneven = result["average_uneven"]
    assert uneven["True"]["summed_by"] == ["device", "device"] and uneven["False"]["summed_by"] != ["device"] * 2
    assert_same_history(uneven["True"]["history"], uneven["False"]["history"])
    assert result["average_uneven_gap"] < 1e-6, result["average_uneven_gap"]
    dead = result["dead"]
    assert dead["error"] and "worker 1" in dead["error"] and "SIGKILL" in dead["error"], dead
    assert dead["status"] == "failed" and dead["seconds"] < 30, dead
