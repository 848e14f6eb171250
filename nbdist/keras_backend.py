"""Which Keras backend a run uses (the notebook's), and what a worker needs to run it (pure logic).

Keras reads ``KERAS_BACKEND`` (else ``$KERAS_HOME/keras.json``, else ``~/.keras/keras.json``) once,
when it is first imported; a worker must therefore be told the notebook's backend in its
environment, before it imports Keras. Imports no third-party package: it runs on Spark executors
and in a worker before Keras is loaded.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

ENV = "KERAS_BACKEND"
BACKENDS = ("tensorflow", "jax", "torch")
DEFAULT = "tensorflow"
# The package a backend imports, and what to install for it on a worker's machine.
PACKAGES = {"tensorflow": ("tensorflow", "tensorflow"), "jax": ("jax", "jax[cpu]"), "torch": ("torch", "torch")}


def configured_backend(environ: Mapping[str, str] | None = None) -> str:
    """The backend Keras would pick in a process started with ``environ``, without importing Keras."""
    environ = os.environ if environ is None else environ
    name = environ.get(ENV, "").strip()
    if name:
        return name
    home = environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        config = json.loads(Path(home, "keras.json").read_text())
    except (OSError, ValueError):
        return DEFAULT
    value = config.get("backend") if isinstance(config, dict) else None
    return value if isinstance(value, str) and value else DEFAULT


def notebook_backend(environ: Mapping[str, str] | None = None) -> str:
    """The notebook's backend: Keras' own answer once it is imported, else what it would pick."""
    keras = sys.modules.get("keras")
    backend = getattr(getattr(keras, "backend", None), "backend", None)
    if callable(backend):
        return str(backend())
    return configured_backend(environ)


def missing_package(backend: str) -> str | None:
    """One sentence when this Python cannot run ``backend``'s Keras (its package is absent), else None."""
    if backend not in PACKAGES:
        return (f"the notebook's Keras runs on a backend nbdist does not support ({backend!r}); use one of "
                f"{', '.join(BACKENDS)}.")
    module, install = PACKAGES[backend]
    if importlib.util.find_spec(module) is None:
        return (f"the notebook's Keras runs on the {backend} backend but this worker's Python ({sys.executable}) has "
                f"no {module}; install it on the workers' machines (pip install '{install}').")
    return None
