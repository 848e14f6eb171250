"""The modules the data and the model pass through from each entry point to the driver's job (issue 37).

How it counts: ``sys.settrace`` over a real call of each entry (``nbdist.train``, a ``%%dist_train`` cell's
``model.fit``, ``%dist_evaluate``, ``%dist_predict``, ``%%dist_tune``) on scikit-learn's digits. A call into an
nbdist function is on the data's road when one of its arguments is the data (by identity), a container holding
it, or what an earlier call on the road returned (FitData, a fit call, a tuple of them); the same for the model
(any keras.Model). Tracing stops where the job is made (``Run.__init__``, driver/run.py), so no worker starts.
The road is the sequence of modules of those calls, consecutive repeats collapsed; "modules" counts the distinct
ones (the entry's own module included) where a call carries the object (hands a form of it back, or passes it
further down); "returns" the road's turns: distinct (callee, caller) module pairs in different packages where a
form of it is handed back up (a package's modules handing each other forms are one place, and the same helper
called for x, y and the weights is one turn; --verbose also gives every returning call). Calls that only look
at it (a check, a predicate) are listed apart, as where it is checked.

    PYTHONPATH=$PWD python scripts/door_paths.py [--verbose | --crossings]
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


def _package(module: str) -> str:
    """nbdist.data.inputs -> data; nbdist.api -> api."""
    return module.removeprefix("nbdist.").split(".")[0]


def _holds_arrays(value: Any) -> bool:
    """An nbdist value holding arrays (FitData: the data as numpy), one level deep."""
    fields = getattr(value, "__dict__", None)
    return (type(value).__module__.startswith("nbdist") and isinstance(fields, dict)
            and any(type(v).__name__ == "ndarray" for v in fields.values()))


class Road:
    """One object's road (the data's or the model's) through nbdist's modules.

    A call is on the road when an argument carries the object. It *carries* it when it hands back a form of
    it (the object or a container of it; for the data also an nbdist value holding arrays, such as FitData,
    or an array) or passes it on into another module that carries it; it only *looks* at it (a check or a
    predicate) otherwise. Only what crosses a module's border counts (helpers within a module are that
    module's business): modules count the modules that carried it, returns the crossings that hand a form of
    it back up into the calling module; the looks' modules are where it is checked."""

    def __init__(self, is_it: Any, arrays: bool) -> None:
        self.is_it = is_it
        self.arrays = arrays
        self.derived: set[int] = set()
        self.keep: list[Any] = []  # derived objects stay alive, so their ids stay theirs
        self.on_road: dict[int, list[Any]] = {}  # frame id -> [module, has a road child]
        self.carry_modules: list[str] = []
        self.look_modules: list[str] = []
        self.returns = 0
        # Distinct (callee, caller) pairs across packages where a form of it is handed back up: the road's
        # turns. A package's own modules handing each other forms (data.inputs <- data.structures) are
        # one place; the same helper called for x, y and the weights is one turn.
        self.return_edges: set[tuple[str, str]] = set()
        self.crossings: list[str] = []  # module.function of each carrying crossing, as it ended

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

    def _form(self, value: Any) -> bool:
        if value is None or isinstance(value, (bool, int, float, str)):
            return False
        if self.carries(value) or (self.arrays and _holds_arrays(value)):
            return True
        if isinstance(value, (tuple, list)):
            return any(self._form(v) for v in value)
        return self.arrays and type(value).__name__ == "ndarray"

    def call(self, frame: Any, module: str) -> None:
        if any(self.carries(v) for v in list(frame.f_locals.values())):
            self.on_road[id(frame)] = [module, False, frame.f_code.co_name]

    def _road_caller(self, frame: Any) -> Any:
        caller = frame.f_back
        while caller is not None and id(caller) not in self.on_road:
            caller = caller.f_back
        return caller

    def ret(self, frame: Any, value: Any) -> None:
        entry = self.on_road.pop(id(frame), None)
        if entry is None:
            return
        module, passed_on, function = entry
        handed_back = self._form(value)
        if handed_back:
            for v in (value, *(value if isinstance(value, tuple) else ())):
                if v is None or isinstance(v, (bool, int, float, str)):
                    continue  # shared singletons and small values carry nothing
                self.derived.add(id(v))
                self.keep.append(v)
        caller = self._road_caller(frame)
        caller_module = self.on_road[id(caller)][0] if caller is not None else None
        if caller_module == module:  # within one module: what matters is what crosses its border
            if passed_on:
                self.on_road[id(caller)][1] = True
            return
        if not (handed_back or passed_on):
            self.look_modules.append(module)
            return
        self.carry_modules.append(module)
        self.crossings.append(f"{module.removeprefix('nbdist.')}.{function}{' (returned)' if handed_back else ''}")
        if caller is not None:
            self.on_road[id(caller)][1] = True
            if handed_back:
                self.returns += 1
                caller_module = self.on_road[id(caller)][0]
                if _package(module) != _package(caller_module):
                    self.return_edges.add((module, caller_module))

    def summary(self) -> tuple[int, int, list[str], list[str]]:
        """Modules it was carried in (in the order it left them), returns, and modules it was looked at in."""
        modules = list(dict.fromkeys(self.carry_modules))
        looks = sorted(set(self.look_modules))
        return len(modules), len(self.return_edges), modules, looks


def trace(run: Any, data: Any) -> tuple[Road, Road]:
    import keras

    roads = (Road(lambda v: v is data, True), Road(lambda v: isinstance(v, keras.Model), False))

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
    for road in roads:  # the frames still open called down to the job: each carried the object there
        road.carry_modules.extend(module for module, _, _ in reversed(list(road.on_road.values())))
    return roads


def main() -> None:
    import keras
    import numpy as np
    from IPython.core.interactiveshell import InteractiveShell
    from sklearn.datasets import load_digits

    import nbdist
    from nbdist.magics import DistMagics, EvaluateMagics, TuneMagics

    verbose = "--verbose" in sys.argv or "--crossings" in sys.argv
    crossings = "--crossings" in sys.argv
    digits = load_digits()
    X, y = digits.data.astype("float32") / 16.0, digits.target.astype("int64")

    def model() -> Any:
        m = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
        m.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
        return m

    trained = model()
    trained.fit(X[:64], y[:64], epochs=1, verbose=0)
    shell = InteractiveShell.instance()
    shell.showtraceback = lambda *args, **kwargs: None  # the cell's fit ends at the job (Reached): no traceback
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
        (dm, dr, dp, dl), (mm, mr, mp, ml) = data_road.summary(), model_road.summary()
        print(f"{name:26} {dm:>15} / {dr:<4} {mm:>16} / {mr:<4}")
        if verbose:
            for what, mods, looks in (("data", dp, dl), ("model", mp, ml)):
                print(f"   {what:5} carried in: {', '.join(m.removeprefix('nbdist.') for m in mods)}")
                print(f"   {what:5} looked at in: {', '.join(m.removeprefix('nbdist.') for m in looks)}")
            for what, road in (("data", data_road), ("model", model_road)):
                turns = sorted(f"{a.removeprefix('nbdist.')} -> {b.removeprefix('nbdist.')}"
                               for a, b in road.return_edges)
                print(f"   {what:5} handed back up: {', '.join(turns) or 'never'} ({road.returns} returning calls)")
            if crossings:
                print("   data crossings:", ", ".join(data_road.crossings))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
