"""The dashboard in real kernels: the widget dashboard in an nbclient-executed notebook, the HTML
renderer where widgets are not rendered, the text renderer in a terminal IPython, background runs.

The pure view logic and the renderers fed in-process are in tests/unit/test_dashboard_units.py."""
from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "TF_CPP_MIN_LOG_LEVEL": "2"}

SETUP = """\
%load_ext nbdist
import keras
from sklearn.datasets import load_digits
X, y = load_digits(return_X_y=True)
X = (X / 16).astype("float32")
Xv, yv = X[:300], y[:300]
"""
MODEL = """\
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
"""
EPOCHS = 3
# Far more than run before the interrupt lands (20-70 epochs): an interrupt lost inside a garbage collector's
# callback let the run go on to its last epoch (driver/interrupts.py interrupts_noted).
INTERRUPTED_EPOCHS = 3000


# -- notebooks executed with nbclient ----------------------------------------------------------------

def run_notebook(cells: list[str], env: dict[str, str] | None = None, timeout: int = 240,
                 interrupt: tuple[int, Callable[[dict], bool]] | None = None):
    """Execute ``cells`` in a fresh kernel. ``interrupt=(i, when)``: while cell i runs, interrupt the
    kernel the way JupyterLab's button does, as soon as ``when(widget_state)`` holds."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", store_widget_state=True)
    if interrupt is not None:
        client.on_cell_execute = lambda cell, cell_index: (
            cell_index == interrupt[0] and _interrupt_when(client, interrupt[1], timeout))
    old = dict(os.environ)
    os.environ.update({**ENV, **(env or {})})
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    return nb


def _interrupt_when(client, when: Callable[[dict], bool], timeout: float) -> None:
    """Watch the kernel's widget messages on a thread; interrupt the kernel once ``when`` holds."""

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if when(dict(client.widget_state)):
                asyncio.run(client.km.interrupt_kernel())  # SIGINT to the kernel, like the toolbar button
                return
            time.sleep(0.1)

    threading.Thread(target=watch, daemon=True).start()


def widget_models(nb) -> dict[str, dict]:
    return nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]


def decode_array(model: dict, name: str) -> np.ndarray:
    """bqplot sends arrays as binary buffers; nbclient stores them base64-encoded."""
    value = model["state"][name]
    for buf in model.get("buffers", []):
        if buf["path"][0] == name:
            raw = base64.b64decode(buf["data"])
            return np.frombuffer(raw, dtype=value["dtype"]).reshape(value["shape"])
    return np.asarray(value)


@pytest.fixture(scope="module")
def widget_notebook():
    return run_notebook([
        SETUP,
        f"%%dist_train --data X,y --validation-data Xv,yv --epochs {EPOCHS} --batch-size 64 --workers 2 "
        f"--seed 0\nprint('the cell body printed this')\n{MODEL}",
        # --background then job.wait(): the cell returns at once, history arrives later.
        f"%%dist_train --data X,y --epochs 2 --batch-size 64 --workers 2 --out bg --background\n{MODEL}",
        "print('returned:', bg_job.status, len(bg.get('loss', [])))\n"
        "bg_job.wait(timeout=120)\n"
        "print('waited:', bg_job.status, len(bg['loss']), type(bg).__name__)",
        # --background then the dashboard's Stop button.
        f"%%dist_train --data X,y --epochs 200 --batch-size 64 --workers 2 --out st --background\n{MODEL}",
        "import time\n"
        "deadline = time.monotonic() + 120\n"
        "while len(st_job.history.get('loss', [])) < 1 and time.monotonic() < deadline:\n"
        "    time.sleep(0.2)\n"
        "dash = [l for l in st_job.listeners if hasattr(l, 'stop_button')][0]\n"
        "t0 = time.monotonic(); dash.stop_button.click()\n"
        "print('stopped:', st_job.status, len(st['loss']), round(time.monotonic() - t0, 1))\n"
        "print('draws:', dash.draws, 'seconds:', round(st_job.state.elapsed, 2))",
        # Blocking mode, interrupted by the kernel's interrupt (the test sends it once 2 epochs show).
        f"%%dist_train --data X,y --epochs {INTERRUPTED_EPOCHS} --batch-size 64 --workers 2 --out hi\n"
        f"{MODEL}before = [w.copy() for w in model.get_weights()]",
        "import numpy as np, psutil\n"
        "changed = not all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))\n"
        "workers = [p for p in psutil.Process().children(recursive=True)\n"
        "           if 'nbdist.worker' in ' '.join(p.cmdline()) and '--fork-server' not in p.cmdline()]\n"
        "acc = float((model.predict(X, verbose=0).argmax(1) == y).mean())\n"
        "print('interrupted:', len(hi['loss']), changed, len(workers), round(acc, 3))",
    ], interrupt=(6, lambda ws: any(m.get("max") == INTERRUPTED_EPOCHS and m.get("value", 0) >= 2
                                     for m in ws.values())))


def test_widget_state_holds_the_finished_run(widget_notebook):
    nb = widget_notebook
    models = widget_models(nb)
    # The first dashboard is the blocking run: find its widgets through its output's view.
    view = next(o for o in nb.cells[1].outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {}))
    root = models[view["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]]

    def descendants(model_id: str):
        m = models[model_id]
        yield m
        for child in m["state"].get("children", []):
            yield from descendants(child.replace("IPY_MODEL_", ""))

    mine = list(descendants(root["model_id"] if "model_id" in root else
                            view["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]))
    epochs = [m for m in mine if m["model_name"] == "IntProgressModel"]
    assert len(epochs) == 1 and epochs[0]["state"]["value"] == epochs[0]["state"]["max"] == EPOCHS
    workers = [m for m in mine if m["model_name"] == "FloatProgressModel"]
    assert len(workers) == 2 and all(m["state"]["value"] == 1.0 for m in workers)
    states = [m["state"]["value"] for m in mine if "nbdist-worker-state" in str(m["state"].get("value", ""))]
    assert len(states) == 2 and all("<b>done</b>" in s for s in states)
    # Charts: figures are children of the chart box; their Lines hold one point per epoch.
    figures = [m for m in mine if m["model_name"] == "FigureModel"]
    titles = sorted(m["state"]["title"] for m in figures)
    assert titles == ["accuracy", "loss", "seconds per epoch", "time per phase"]
    lines = {}
    for fig in figures:
        for mark in fig["state"]["marks"]:
            m = models[mark.replace("IPY_MODEL_", "")]
            if m["model_name"] == "LinesModel":
                lines[(fig["state"]["title"], m["state"]["labels"][0])] = decode_array(m, "y")
    assert set(lines) == {(t, s) for t in ("loss", "accuracy") for s in ("train", "validation")}
    assert all(v.shape == (EPOCHS,) for v in lines.values())
    assert lines[("loss", "train")][-1] < lines[("loss", "train")][0]  # it learned
    # The phase view holds real seconds: every worker computed and synchronised.
    def bars(title):
        return [models[m.replace("IPY_MODEL_", "")] for f in figures if f["state"]["title"] == title
                for m in f["state"]["marks"]][0]

    compute, sync = decode_array(bars("time per phase"), "y")
    assert all(c > 0 for c in compute) and all(0 < s < c for s, c in zip(sync, compute)), (compute, sync)
    # The timeline: one stacked bar per epoch, adding up to about the workers' mean totals.
    per_epoch = decode_array(bars("seconds per epoch"), "y")
    assert per_epoch.shape == (2, EPOCHS) and (per_epoch > 0).all(), per_epoch
    assert per_epoch[1].sum() == pytest.approx(np.mean(sync), rel=0.35)
    # The log panel holds each worker's own output (kept after the run's log files were removed).
    logs = [m["state"]["value"] for m in mine if "nbdist-log" in str(m["state"].get("value", ""))]
    assert len(logs) == 2 and all("worker" in t for t in logs), logs
    # Updated in place: the cell's own output survives, one dashboard, no clear_output.
    outs = nb.cells[1].outputs
    assert any("the cell body printed this" in o.get("text", "") for o in outs)
    assert sum("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in outs) == 1
    assert not any(o.get("output_type") == "clear_output" for o in outs)
    # The static summary replaced the empty placeholder: table and PNG survive without widgets.
    html_out = [o["data"]["text/html"] for o in nb.cells[1].outputs if "text/html" in o.get("data", {})]
    assert any("nbdist-summary" in h and "data:image/png;base64," in h for h in html_out)


def test_background_run_returns_at_once_and_wait_collects_history(widget_notebook):
    text = "".join(o.get("text", "") for o in widget_notebook.cells[3].outputs)
    assert "waited: done 2 dict" in text, text
    returned = text.split("returned: ")[1].split()
    assert returned[0] in ("starting", "running")


def test_stop_button_ends_a_background_run(widget_notebook):
    text = "".join(o.get("text", "") for o in widget_notebook.cells[5].outputs)
    stopped = text.split("stopped: ")[1].split()
    assert stopped[0] == "stopped", text
    assert 1 <= int(stopped[1]) < 200
    assert float(stopped[2]) < 15
    # The dashboard redrew, but throttled: at most 5 draws a second (+ start and end).
    draws, seconds = int(text.split("draws: ")[1].split()[0]), float(text.split("seconds: ")[1].split()[0])
    assert 2 <= draws <= 5 * seconds + 3, (draws, seconds)


def test_kernel_interrupt_stops_the_run_and_keeps_the_last_synchronised_weights(widget_notebook):
    nb = widget_notebook
    outs = nb.cells[6].outputs
    assert not any(o.get("output_type") == "error" for o in outs), outs  # the cell ended normally
    text = "".join(o.get("text", "") for o in nb.cells[7].outputs)
    done, changed, workers, acc = text.split("interrupted: ")[1].split()
    assert 2 <= int(done) < INTERRUPTED_EPOCHS
    assert changed == "True" and int(workers) == 0
    assert float(acc) > 0.25  # trained (averaged) weights: the initial ones score ~0.1 on 10 classes
    # The dashboard says so.
    models = widget_models(nb)
    view = next(o for o in outs if "application/vnd.jupyter.widget-view+json" in o.get("data", {}))
    root = models[view["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]]
    header = models[root["state"]["children"][0].replace("IPY_MODEL_", "")]["state"]["value"]
    assert "<b>stopped</b>" in header, header
    summary = [o["data"]["text/html"] for o in outs if "nbdist-summary" in o.get("data", {}).get("text/html", "")]
    assert summary and "Stopped (interrupted)" in summary[0]


# -- fallbacks: a terminal IPython (Zeppelin's HTML: test_zeppelin.py) ---------------------------------------

def test_text_renderer_in_a_terminal_ipython(tmp_path):
    script = tmp_path / "run.ipy"
    # An .ipy script is one cell, so the cell magic is called the way IPython runs a %% line.
    script.write_text(SETUP + "get_ipython().run_cell_magic('dist_train', "
                      f"'--data X,y --epochs 2 --batch-size 64 --workers 2', {MODEL!r})\n"
                      "print('history', len(history['loss']))\n")
    out = subprocess.run([PYTHON, "-m", "IPython", "--no-banner", "--colors=NoColor", str(script)],
                         env=ENV, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Epoch 1/2" in out.stdout and "Epoch 2/2" in out.stdout, out.stdout
    assert "history 2" in out.stdout and "<" not in out.stdout.split("Epoch 1/2")[1]  # plain text, no HTML
