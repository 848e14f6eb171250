"""``import nbdist`` imports no deep-learning framework: a notebook pays for Keras only when it uses it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("keras", "tensorflow", "torch", "jax", "numpy")


def test_importing_nbdist_and_reading_its_signatures_imports_no_framework():
    code = (f"import inspect, json, sys; import nbdist; before = [m for m in {HEAVY!r} if m in sys.modules]; "
            "inspect.signature(nbdist.train); inspect.signature(nbdist.tune); "
            f"print(json.dumps([before, [m for m in {HEAVY!r} if m in sys.modules]]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, check=True)
    at_import, after_signatures = json.loads(out.stdout.splitlines()[-1])
    assert at_import == []  # not even numpy
    assert not {"keras", "tensorflow", "torch", "jax"} & set(after_signatures)
