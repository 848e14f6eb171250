"""The JAX-only install tier (scripts/install_tiers.sh runs it with a fresh venv's Python, outside the checkout).

``no-torch``: the venv holds ``nbdist[jax,notebook]`` and nothing more. TensorFlow and torch are not importable;
``import nbdist`` and ``%load_ext nbdist`` work; one worker trains, and two (meeting through shared memory) train
the same step; ``--engine gloo`` is refused before any worker starts, in one sentence naming what to install.
``quickstart``: still no TensorFlow and no torch. notebooks/01_quickstart.ipynb's cells run in a real kernel with
2 workers, then ``%dist_evaluate`` on 2 workers gives what ``model.evaluate`` gives in the notebook.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"install tier (jax only) failed: {what}")
    print(f"ok: {what}", flush=True)


def no_torch() -> None:
    import nbdist

    check("site-packages" in str(nbdist.__file__), f"nbdist comes from the venv ({nbdist.__file__})")
    for name in ("tensorflow", "torch"):
        check(importlib.util.find_spec(name) is None, f"{name} is not installed")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    check("dist_train" in shell.magics_manager.magics["cell"], "%load_ext nbdist registers %%dist_train")
    shell.run_cell("import keras, numpy as np\nassert keras.backend.backend() == 'jax'\n"
                   "rng = np.random.default_rng(0)\nX = rng.normal(size=(256, 8)).astype('float32')\n"
                   "y = (X[:, 0] > 0).astype('int32')", store_history=False).raise_error()
    cell = ("model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation='softmax')])\n"
            "model.compile('sgd', 'sparse_categorical_crossentropy')")
    one = shell.run_cell(f"%%dist_train --data X,y --epochs 1 --workers 1 --ui none\n{cell}", store_history=False)
    check(one.success and len(shell.user_ns["history"]["loss"]) == 1, "one worker trains without torch")
    two = shell.run_cell(f"%%dist_train --data X,y --epochs 1 --workers 2 --batch-size 16 --ui none\n{cell}",
                         store_history=False)
    check(two.success and len(shell.user_ns["history"]["loss"]) == 1, "two workers train without torch")
    shell.run_cell("import nbdist\nlocal = keras.models.clone_model(model); local.compile('sgd', "
                   "'sparse_categorical_crossentropy'); local.set_weights(model.get_weights())\n"
                   "remote = keras.models.clone_model(model); remote.compile('sgd', "
                   "'sparse_categorical_crossentropy'); remote.set_weights(model.get_weights())\n"
                   "want = local.fit(X, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history['loss']\n"
                   "got = nbdist.train(remote, X, y, batch_size=32, epochs=2, workers=2, shuffle=False,\n"
                   "                   lr_scaling='none').history['loss']\n"
                   "gap = max(abs(a - b) for a, b in zip(want, got))", store_history=False).raise_error()
    gap = shell.user_ns["gap"]
    check(gap < 1e-5, f"two workers without torch take the local step (loss {gap:.1e} from local fit)")
    engine = shell.run_cell(f"%%dist_train --data X,y --epochs 1 --workers 2 --engine gloo --ui none\n{cell}",
                            store_history=False)
    message = str(engine.error_in_exec)
    check(type(engine.error_in_exec).__name__ == "UsageError" and "pip install 'nbdist[torch]'" in message
          and "\n" not in message, f"--engine gloo without torch: one sentence, {message!r}")


def quickstart() -> None:
    import nbformat
    from jupyter_client import KernelManager
    from nbclient import NotebookClient

    for name in ("tensorflow", "torch"):
        check(importlib.util.find_spec(name) is None, f"{name} is still not installed")
    nb = nbformat.read(ROOT / "notebooks" / "01_quickstart.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    check("--workers 2" in code[1].source, "the quickstart trains on 2 workers")
    nb.cells.append(nbformat.v4.new_code_cell("%dist_evaluate model --data X_test,y_test --workers 2"))
    nb.cells.append(nbformat.v4.new_code_cell(
        "local = model.evaluate(X_test, y_test, verbose=0, return_dict=True)\n"
        "assert abs(local['loss'] - evaluation['loss']) < 1e-5, (local, evaluation)\n"
        "assert abs(local['accuracy'] - evaluation['accuracy']) < 1e-6, (local, evaluation)\n"
        "print('evaluate agrees', round(evaluation['accuracy'], 4))"))
    with tempfile.TemporaryDirectory(prefix="nbdist-tier-") as sockets:
        kernel = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
        client = NotebookClient(nb, km=kernel, timeout=600, startup_timeout=300,
                                extra_arguments=["--DistMagics.ui=text"],  # no browser: one line per epoch
                                resources={"metadata": {"path": sockets}})
        started = time.monotonic()
        client.execute()
    outputs = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.output_type == "stream")
    print(outputs, flush=True)
    check("test accuracy" in outputs, "the quickstart's last cell printed its accuracy")
    check("evaluate agrees" in outputs, "%dist_evaluate on 2 workers equals the notebook's model.evaluate")
    print(f"quickstart and evaluate: {time.monotonic() - started:.0f} s", flush=True)


if __name__ == "__main__":
    os.environ["KERAS_BACKEND"] = "jax"
    {"no-torch": no_torch, "quickstart": quickstart}[sys.argv[1]]()
