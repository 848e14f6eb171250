"""Which Keras backend a run uses (the notebook's), and what a worker needs to run it (pure logic).

Keras reads ``KERAS_BACKEND`` (else ``$KERAS_HOME/keras.json``, else ``~/.keras/keras.json``) once,
when it is first imported; a worker must therefore be told the notebook's backend in its
environment, before it imports Keras. Imports no third-party package: it runs on Spark executors
and in a worker before Keras is loaded.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from collections.abc import Iterator, Mapping
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


# Packages TensorFlow and Keras import at start-up whenever they are installed, for features a worker never
# uses: TensorFlow Lite's JAX conversion (jax: ~150 MB of RSS), Keras' pandas slicing (pandas, and pyarrow
# through it: ~95 MB) and its scikit-learn wrappers (sklearn: ~60 MB). Measured together, a TensorFlow
# worker's imports take 0.92 GB of RSS instead of 1.23. A worker's data reaches Keras as numpy only.
OPTIONAL_AT_IMPORT = ("jax", "pandas", "sklearn")


@contextlib.contextmanager
def optional_packages_hidden(backend: str | None = None) -> Iterator[None]:
    """While Keras and its backend are imported in a worker: the packages above hidden, so each module
    that tries them takes its documented fallback (``except ImportError``). Only meanwhile: whatever the
    job imports later (the notebook's own code, pyarrow for Spark shards) imports them as usual. The JAX
    backend needs jax itself, so it is never hidden from it."""
    backend = backend or configured_backend()
    hidden = [m for m in OPTIONAL_AT_IMPORT if m not in sys.modules and not (m == "jax" and backend == "jax")]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # importing it raises ImportError while set
    try:
        yield
    finally:
        for name in hidden:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
