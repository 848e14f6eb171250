"""The modules the data and the model pass through from each entry point to the driver's job (issue 37).

How it counts: ``sys.settrace`` over a real call of each entry (``nbdist.train``, a ``%%dist_train`` cell's
``model.fit``, ``%dist_evaluate``, ``%dist_predict``, ``%%dist_tune``) on scikit-learn's digits. A call into an
nbdist function is on the data's road when one of its arguments is the data (by identity), a container holding
it, or what an earlier call on the road returned (FitData, a fit call, a tuple of them); the same for the model
(any keras.Model). Tracing stops where the job is made (``Run.__init__``, driver/run.py), so no worker starts.
The road is the sequence of modules of those calls, consecutive repeats collapsed; "modules" counts the distinct
ones (the entry's own module included), "returns" the steps back to a module higher up the call chain (a callee
returning into its caller's module, which then carries the object on).

    PYTHONPATH=$PWD python scripts/door_paths.py [--verbose]
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "nbdist")
SKIP = {"nbdist", "nbdist.errors"}  # the lazy forwarders in __init__, and the exception type
log = logging.getLogger("door_paths")


class Reached(Exception):
    """Raised at the job's constructor: the road ends there."""


def _module(frame: Any) -> str | None:
    path = os.path.abspath(frame.f_code.co_filename)
    if not path.startswith(ROOT + os.sep):
        return None
    rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
    return rel[:-9] if rel.endswith(".__init__") else rel


class Road:
    """One object's road (the data's or the model's) through nbdist's modules."""

    def __init__(self, is_it: Any) -> None:
        self.is_it = is_it
        self.derived: set[int] = set()
        self.keep: list[Any] = []  # derived objects stay alive, so their ids stay theirs
        self.path: list[str] = []
        self.returns = 0
        self.on_road: dict[int, str] = {}  # frame id -> module, for frames on the road

    def carries(self, value: Any, depth: int = 0) -> bool:
        if self.is_it(value) or id(value) in self.derived:
            return True
        if depth > 0:
            return False
        if isinstance(value, dict):
            return any(self.carries(v, 1) for v in list(value.values())[:64])
        if isinstance(value, (list, tuple)):
            return any(self.carries(v, 1) for v in list(value)[:64])
        fields = getattr(value, "__dict__", None)
        if isinstance(fields, dict) and type(value).__module__.startswith("nbdist"):
            return any(self.carries(v, 1) for v in list(fields.values())[:64])
        return False

    def call(self, frame: Any, module: str) -> None:
        if not any(self.carries(v) for v in list(frame.f_locals.values())):
            return
        self.on_road[id(frame)] = module
        if not self.path or self.path[-1] != module:
            self.path.append(module)

    def ret(self, frame: Any, value: Any) -> None:
        module = self.on_road.pop(id(frame), None)
        if module is None:
            return
        if value is not None and not isinstance(value, (bool, int, float, str)):
            self.derived.add(id(value))
            self.keep.append(value)
            if isinstance(value, tuple):
                for v in value:
                    self.derived.add(id(v))
                    self.keep.append(v)
        caller = frame.f_back
        while caller is not None and id(caller) not in self.on_road:
            caller = caller.f_back
        if caller is not None and self.on_road[id(caller)] != module:
            self.returns += 1
            self.path.append(self.on_road[id(caller)])

    def summary(self) -> tuple[int, int, list[str]]:
        return len(set(self.path)), self.returns, self.path


def trace(run: Any, data: Any) -> tuple[Road, Road]:
    import keras

    roads = (Road(lambda v: v is data), Road(lambda v: isinstance(v, keras.Model)))

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        module = _module(frame)
        if module is None or module in SKIP:
            return tracer if event == "call" else None
        if event == "call":
            if module == "nbdist.driver.run" and frame.f_code.co_name == "__init__":
                raise Reached()
            for road in roads:
                road.call(frame, module)
        elif event == "return":
            for road in roads:
                road.ret(frame, arg)
        return tracer

    sys.settrace(tracer)
    threading.settrace(tracer)
    try:
        run()
    except Reached:
        pass
    except Exception as exc:  # a magic turns it into a UsageError, the search into a failed trial
        log.debug("entry ended with %s: %s", type(exc).__name__, exc)
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return roads


def main() -> None:
    import keras
    import numpy as np
    from IPython.core.interactiveshell import InteractiveShell
    from sklearn.datasets import load_digits

    import nbdist
    from nbdist.magics import DistMagics, EvaluateMagics, TuneMagics

    verbose = "--verbose" in sys.argv
    digits = load_digits()
    X, y = digits.data.astype("float32") / 16.0, digits.target.astype("int64")

    def model() -> Any:
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
        m.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
        return m

    trained = model()
    trained.fit(X[:64], y[:64], epochs=1, verbose=0)
    shell = InteractiveShell.instance()
    for magics in (DistMagics, EvaluateMagics, TuneMagics):
        shell.register_magics(magics)
    shell.user_ns.update(X=X, y=y, keras=keras, model=trained, np=np)
    cell = ("m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation='softmax')])\n"
            "m.compile('adam', 'sparse_categorical_crossentropy', metrics=['accuracy'])\n"
            "m.fit(X, y, epochs=1, batch_size=64, validation_split=0.1)\n")
    entries = {
        "nbdist.train": lambda: nbdist.train(model(), X, y, epochs=1, workers=1),
        "%%dist_train (cell fit)": lambda: shell.run_cell_magic("dist_train", "--workers 1 --ui none", cell),
        "%dist_evaluate": lambda: shell.run_line_magic("dist_evaluate", "model --data X,y --workers 1"),
        "%dist_predict": lambda: shell.run_line_magic("dist_predict", "model --data X --workers 1"),
        "%%dist_tune": lambda: shell.run_cell_magic(
            "dist_tune", "--trials 1 --parallel 1 --ui none --storage sqlite:///:memory: --models-dir none",
            cell.replace("m.fit(", "trial.suggest_int('u', 1, 2)\nm.fit(")),
    }
    print(f"{'entry':26} {'data: modules/returns':>22} {'model: modules/returns':>23}")
    for name, run in entries.items():
        data_road, model_road = trace(run, X)
        (dm, dr, dp), (mm, mr, mp) = data_road.summary(), model_road.summary()
        print(f"{name:26} {dm:>15} / {dr:<4} {mm:>16} / {mr:<4}")
        if verbose:
            print("   data: ", " > ".join(p.removeprefix("nbdist.") for p in dp))
            print("   model:", " > ".join(p.removeprefix("nbdist.") for p in mp))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
