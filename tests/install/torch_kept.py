"""The install tier's torch step: run by scripts/install_tiers.sh with the Python of a venv that held torch
``expected`` before ``pip install nbdist[jax,torch]``: that torch is still there, and nbdist loads on it."""
from __future__ import annotations

import os
import sys
from importlib.metadata import version


def main(expected: str) -> None:
    found = version("torch")
    if found.split("+")[0] != expected:  # 2.13.0+cpu is the 2.13.0 that was there
        raise SystemExit(f"install tier (torch kept) failed: pip replaced torch {expected} by {found}")
    print(f"ok: torch {found} left in place", flush=True)
    os.environ["KERAS_BACKEND"] = "torch"
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    shell.run_cell("import keras\nassert keras.backend.backend() == 'torch'", store_history=False).raise_error()
    print("ok: %load_ext nbdist on Keras' torch backend", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
