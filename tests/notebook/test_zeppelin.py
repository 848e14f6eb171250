"""Zeppelin's IPython interpreter (``%python.ipython``), driven as Zeppelin drives it, with no Zeppelin here.

What Zeppelin does, read in its source (apache/zeppelin):
- ParagraphTextParser: a paragraph's first ``%name`` picks the interpreter; the text after it, leading spaces
  stripped (the newline kept), is the code.
- JupyterKernelInterpreter launches ``python <tmp>/kernel_server.py <kernel> <port>`` from a new temporary
  directory named ``zeppelin_jupyter_kernel_<kernel>...``, with the interpreter process's environment;
  IPythonInterpreter (kernel "python") adds that directory's py4j zip in front of PYTHONPATH and sets
  PY4J_GATEWAY_SECRET.
- kernel_server.py starts the kernel with ``jupyter_client.manager.start_new_kernel`` and runs each paragraph
  with ``execute_interactive``; its output hook forwards stream, display_data / execute_result (the first of
  text/html, image/jpeg, image/png, application/javascript, text/plain), error and clear_output, nothing else
  (no update_display_data, no comm messages), then the reply's payloads as text.

The launcher below is this test's own program doing those steps; it prints each forwarded output as a JSON line
with its arrival time, which is what a Zeppelin paragraph would show and when. The same cell in a kernel started
by Jupyter (nbclient) gets the widgets: tests/notebook/test_dashboard.py.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EPOCHS = 3

LAUNCHER = r'''
import json, sys, time

import jupyter_client

FIRST = ("text/html", "image/jpeg", "image/png", "application/javascript",
         "application/vnd.holoviews_load.v0+json", "text/plain")


def emit(**record):
    print(json.dumps({"t": time.time(), **record}), flush=True)


def main(kernel_name, paragraphs_file):
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name=kernel_name, startup_timeout=300)
    try:
        for index, code in enumerate(json.load(open(paragraphs_file))):
            def hook(msg, index=index):
                kind, content = msg["header"]["msg_type"], msg["content"]
                if kind == "stream":
                    emit(paragraph=index, type="TEXT", output=content["text"])
                elif kind in ("display_data", "execute_result"):
                    mime = next((m for m in FIRST if m in content["data"]), None)
                    if mime is not None:
                        emit(paragraph=index, type=mime, output=content["data"][mime])
                elif kind == "error":
                    emit(paragraph=index, type="ERROR", output="\n".join(content["traceback"]))
                elif kind == "clear_output":
                    emit(paragraph=index, type="CLEAR", output="")

            reply = kc.execute_interactive(code, output_hook=hook, timeout=600)
            for payload in reply["content"].get("payload", []):
                if payload.get("data", {}).get("text/plain"):
                    emit(paragraph=index, type="TEXT", output=payload["data"]["text/plain"])
            emit(paragraph=index, type="END", output=reply["content"]["status"])
    finally:
        km.shutdown_kernel(now=True)


main(sys.argv[1], sys.argv[2])
'''

MODEL = ('model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),\n'
         '                          keras.layers.Dense(10, activation="softmax")])\n'
         'model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])')

PARAGRAPHS = [
    "%python.ipython\n%load_ext nbdist\nimport keras\nfrom sklearn.datasets import load_digits\n"
    "X, y = load_digits(return_X_y=True)\nX = (X / 16).astype('float32')\n"
    "from nbdist.ui import detect_frontend\nprint('frontend:', detect_frontend())",
    # Each epoch starts 0.5 s late on the workers (the cell's own fit, its callback with it): lines that arrive
    # as epochs end are that far apart; lines held back to the end would arrive together.
    f"%python.ipython\n%%dist_train --workers 2 --seed 0\n{MODEL}\n"
    "pause = keras.callbacks.LambdaCallback(on_epoch_begin=lambda epoch, logs: __import__('time').sleep(0.5))\n"
    f"model.fit(X, y, epochs={EPOCHS}, batch_size=64, callbacks=[pause])",
    "%python.ipython\n%dist_evaluate model --data X,y --workers 2",
    "%python.ipython\n%dist_predict model --data X --workers 2",
    "%python.ipython\nprint('evaluated', evaluation['samples'], 'predicted', predictions.shape)",
]

WIDGET_REPR = re.compile(r"\b(VBox|HBox|Output|IntProgress|FloatProgress|Figure)\(")


def zeppelin_script(paragraph: str) -> str:
    """The code Zeppelin sends the kernel for a paragraph (ParagraphTextParser.parse): the ``%name`` interpreter
    text removed, then the leading spaces, not the newline."""
    match = re.match(r"^(\s*)%([a-zA-Z0-9_\-]+(?:\.\w+)*)", paragraph)
    assert match and match.group(2) == "python.ipython"
    return paragraph[len(match.group(1)) + len(match.group(2)) + 1:].lstrip(" ")


def run_as_zeppelin(paragraphs: list[str], tmp: Path) -> list[dict]:
    # A machine with Zeppelin's IPython interpreter has a Jupyter kernel named "python" (the kernel
    # IPythonInterpreter asks for): here, one in a data folder of this test's own.
    spec = tmp / "jupyter" / "kernels" / "python"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    workdir = Path(tempfile.mkdtemp(prefix="zeppelin_jupyter_kernel_python", dir=tmp))
    (workdir / "kernel_server.py").write_text(LAUNCHER)
    py4j = workdir / "py4j-src-0.10.9.7.zip"
    with zipfile.ZipFile(py4j, "w"):
        pass  # a stand-in: nothing here imports py4j
    (workdir / "paragraphs.json").write_text(json.dumps([zeppelin_script(p) for p in paragraphs]))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(py4j), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PY4J_GATEWAY_SECRET"] = secrets.token_hex(32)
    env["JUPYTER_PATH"] = str(tmp / "jupyter")  # where the "python" kernel above is installed
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    launch = [sys.executable, str(workdir / "kernel_server.py"), "python", str(workdir / "paragraphs.json")]
    out = subprocess.run(launch, cwd=workdir, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def zeppelin(tmp_path_factory):
    return run_as_zeppelin(PARAGRAPHS, tmp_path_factory.mktemp("zeppelin"))


def shown(records: list[dict], paragraph: int) -> list[dict]:
    """What the paragraph shows at its end: its outputs after the last clear_output."""
    mine = [r for r in records if r["paragraph"] == paragraph and r["type"] != "END"]
    clears = [i for i, r in enumerate(mine) if r["type"] == "CLEAR"]
    return mine[clears[-1] + 1:] if clears else mine


def test_every_paragraph_runs_without_a_traceback_or_a_widget_repr(zeppelin):
    ends = [r for r in zeppelin if r["type"] == "END"]
    assert [r["output"] for r in ends] == ["ok"] * len(PARAGRAPHS), zeppelin
    for r in zeppelin:
        assert r["type"] != "ERROR", r["output"]
        assert "Traceback" not in r["output"] and not WIDGET_REPR.search(r["output"]), r["output"][:500]
    assert any(r["output"].strip() == "frontend: html" for r in shown(zeppelin, 0))


def test_training_shows_each_epoch_while_it_runs_then_the_summary(zeppelin):
    out = shown(zeppelin, 1)
    html = [r for r in out if r["type"] == "text/html"]
    epochs = [r for r in html if "nbdist-epoch" in r["output"]]
    assert [f"Epoch {e}/{EPOCHS}" in r["output"] for e, r in enumerate(epochs, 1)] == [True] * EPOCHS, out
    summary = [r for r in html if "nbdist-summary" in r["output"]]
    assert len(summary) == 1 and "data:image/png;base64," in summary[0]["output"]
    end = next(r for r in zeppelin if r["paragraph"] == 1 and r["type"] == "END")
    # Each epoch's line arrived as that epoch ended, not in one burst at the end of the run.
    assert epochs[0]["t"] < epochs[-1]["t"] < summary[0]["t"] <= end["t"]
    assert epochs[-1]["t"] - epochs[0]["t"] > 0.5 * (EPOCHS - 1) * 0.9, [r["t"] for r in epochs]


def test_evaluate_and_predict_show_their_results(zeppelin):
    evaluated = " ".join(r["output"] for r in shown(zeppelin, 2))
    assert "accuracy" in evaluated and "loss" in evaluated
    assert shown(zeppelin, 3), "dist_predict showed nothing"
    assert any("evaluated 1797 predicted (1797, 10)" in r["output"] for r in shown(zeppelin, 4))
