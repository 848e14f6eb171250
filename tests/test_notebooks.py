"""The example notebooks execute headlessly, as `make demo` runs them."""
from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(name: str, timeout: int = 600) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    env_root = str(NOTEBOOKS.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (env_root, os.environ.get("PYTHONPATH", "")) if p)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def stream_text(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")


@pytest.mark.usefixtures("no_leftover_workers")
def test_quickstart_notebook_executes():
    text = stream_text(execute("01_quickstart.ipynb"))
    epochs = [ln for ln in text.splitlines() if ln.startswith("Epoch")]
    assert len(epochs) == 20 and epochs[-1].startswith("Epoch 20/20")
    accuracy = float(text.split("test accuracy: ")[1].split()[0])
    assert accuracy > 0.9
