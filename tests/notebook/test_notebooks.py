"""The example notebooks execute headlessly, as `make demo` runs them."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"


def execute(name: str, timeout: int = 600) -> nbformat.NotebookNode:
    """Run a notebook as `make demo` does: headless, its kernel started with ``--DistMagics.ui=text`` so
    that runs without ``--ui`` print text."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    env_root = str(NOTEBOOKS.parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (env_root, os.environ.get("PYTHONPATH", "")) if p)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", extra_arguments=["--DistMagics.ui=text"],
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def stream_text(nb: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")


@pytest.mark.full("the quickstart top to bottom in a kernel, to its epochs and test accuracy: test_browser.py's "
                  "quickstart test (and make demo)")
@pytest.mark.usefixtures("no_leftover_workers")
def test_quickstart_notebook_executes():
    text = stream_text(execute("01_quickstart.ipynb"))
    epochs = [ln for ln in text.splitlines() if ln.startswith("Epoch")]
    assert len(epochs) == 20 and epochs[-1].startswith("Epoch 20/20")
    accuracy = float(text.split("test accuracy: ")[1].split()[0])
    assert accuracy > 0.9


@pytest.mark.full("a CNN under allreduce: tests/workers/test_allreduce.py's CNN test; a notebook top to bottom: "
                  "this module's other notebooks")
@pytest.mark.usefixtures("no_leftover_workers")
def test_lenet_allreduce_notebook_executes():
    text = stream_text(execute("03_lenet_allreduce.ipynb"))
    assert "allreduce on 2 local workers" in text  # the text renderer's header
    epochs = [ln for ln in text.splitlines() if ln.startswith("Epoch")]
    assert len(epochs) == 8 and epochs[-1].startswith("Epoch 8/8")
    found = re.search(r"test accuracy: ([0-9.]+) after 8 epochs", text)
    assert found, text[-2000:]
    assert float(found.group(1)) > 0.9
    predicted = json.loads(text.split("predicted:")[1].splitlines()[0])  # a printed list of ints
    true = json.loads(text.split("true:")[1].splitlines()[0])
    assert sum(p == t for p, t in zip(predicted, true)) >= 8


@pytest.mark.usefixtures("no_leftover_workers")
@pytest.mark.full("an RDD of (features, label) pairs trained by Spark tasks: tests/spark/test_spark_local.py's "
                  "RDD test")
def test_elephas_migration_notebook_executes():
    from ..spark_helpers import need_spark

    need_spark()
    text = stream_text(execute("04_from_elephas.ipynb"))
    assert "in 2 partitions" in text
    assert "averaging on 2 spark workers" in text  # trained by Spark tasks, not local processes
    epochs = [ln for ln in text.splitlines() if ln.startswith("Epoch")]
    assert len(epochs) == 15
    found = re.search(r"test accuracy: ([0-9.]+) after 15 epochs on local\[2\]", text)
    assert found, text[-2000:]
    assert float(found.group(1)) > 0.9  # Elephas reaches about 0.93 on this split


@pytest.mark.usefixtures("no_leftover_workers")
def test_your_keras_cell_notebook_executes():
    """Three well-known Keras cells, unchanged but for the magic line, train on 2 workers."""
    text = stream_text(execute("06_your_keras_cell.ipynb", timeout=900))
    found = re.search(r"convnet: History with 6 epochs; test accuracy: ([0-9.]+)", text)
    assert found, text[-2000:]
    assert float(found.group(1)) > 0.85
    val_auc, eval_auc = map(float, re.search(r"val_auc ([0-9.]+), evaluate auc ([0-9.]+)", text).groups())
    assert val_auc == eval_auc and val_auc > 0.95  # merged exactly, not averaged
    assert float(re.search(r"text: test accuracy: ([0-9.]+)", text).group(1)) > 0.8


@pytest.mark.full("this notebook's search top to bottom, its 4 trials and best_model's line: test_browser.py's "
                  "search test")
@pytest.mark.usefixtures("no_leftover_workers")
def test_tune_notebook_executes():
    """A 4-trial search, 2 at once on local workers: the text view's lines, and best_model scoring the
    study's best value on the validation split it was measured on."""
    text = stream_text(execute("07_tune.ipynb"))
    assert text.count("trial ") >= 4 and "search done: 4/4 trials finished" in text, text[-3000:]
    assert "best val_accuracy after each finished trial:" in text
    found = re.search(r"val_accuracy ([0-9.]+)\nbest_model test accuracy: ([0-9.]+)", text)
    assert found, text[-2000:]
    assert found.group(1) == found.group(2) and float(found.group(1)) > 0.8
    assert "trials: 4, states: ['COMPLETE', 'COMPLETE', 'COMPLETE', 'COMPLETE']" in text
