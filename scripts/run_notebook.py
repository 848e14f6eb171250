"""Execute a notebook headlessly and print what its cells printed (used by `make demo`)."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import nbformat
from jupyter_client import KernelManager
from nbclient import NotebookClient

# Run first in the kernel: TensorFlow loads there without its load-time notices (nbdist/worker/__main__.py).
QUIET_TENSORFLOW = "__import__('nbdist.worker.__main__', fromlist=['_']).quiet_tensorflow_import()"
# The kernel's session setting: a run without --ui prints text (``%config DistMagics.ui = "text"``).
HEADLESS_UI = "--DistMagics.ui=text"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("notebook", type=Path)
    p.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    p.add_argument("--save", type=Path, default=None, help="write the executed notebook here")
    args = p.parse_args()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # keep TensorFlow start-up noise out of the output
    nb = nbformat.read(args.notebook, as_version=4)
    # A kernel on this machine talks over Unix sockets: no unencrypted TCP ports (nor ipykernel's warning).
    # Their path is absolute: the kernel runs in the notebook's folder, this script maybe elsewhere.
    sockets = tempfile.TemporaryDirectory(prefix="nbdist-demo-")
    kernel = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets.name, "kernel"))
    # The kernel imports TensorFlow before it answers (exec_lines): give it the time a loaded machine needs.
    # No browser here: the session's ui (DistMagics.ui, nbdist/magics/train.py) prints one line per epoch.
    client = NotebookClient(nb, km=kernel, timeout=args.timeout, kernel_name="python3", startup_timeout=300,
                            extra_arguments=[f"--IPKernelApp.exec_lines={QUIET_TENSORFLOW}", HEADLESS_UI],
                            resources={"metadata": {"path": str(args.notebook.parent)}})

    def show(cell, cell_index, execute_reply=None, **_):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                sys.stdout.write(out.get("text", ""))
            elif out.get("output_type") == "error":
                sys.stdout.write(f"{out.get('ename')}: {out.get('evalue')}\n")
            elif "text/plain" in out.get("data", {}):
                sys.stdout.write(out["data"]["text/plain"] + "\n")
        sys.stdout.flush()

    client.on_cell_executed = show
    with sockets:
        client.execute()
    if args.save:
        nbformat.write(nb, args.save)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
