"""pytest plugin of the Keras-tests runner (run.py): records each test's outcome and its ``keras.Model.fit`` calls.

``--keras-suite-mode local``: Keras' tests as they are; a counting wrapper around ``keras.Model.fit`` tells
which tests fit a model. ``--keras-suite-mode nbdist``: each test's body runs as the cell of
``%%dist_train --workers 2 --ui none`` in one IPython shell, so the magic's own interception takes every
``keras.Model.fit`` the test makes (all arguments, ``batch_size`` the global batch, the default strategy).
The test's own outcome is the verdict; what the magic says after the body (e.g. that a fit was refused)
is recorded beside it. Results go to ``--keras-suite-record`` as JSON, one entry per test id.
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any

import pytest

MAGIC_LINE = "--workers 2 --ui none"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("keras_suite")
    group.addoption("--keras-suite-mode", choices=("local", "nbdist"), default="local")
    group.addoption("--keras-suite-record", default=None, help="JSON file for the per-test results")
    group.addoption("--keras-suite-only", default=None, help="file of test ids to run (one a line)")


class Recorder:
    def __init__(self, config: Any) -> None:
        self.mode = config.getoption("--keras-suite-mode")
        self.path = config.getoption("--keras-suite-record")
        only = config.getoption("--keras-suite-only")
        self.only = None
        if only:
            with open(only) as f:
                self.only = {line.strip() for line in f if line.strip()}
        self.results: dict[str, dict[str, Any]] = {}
        self.fit_calls = 0
        self.after: list[str] = []
        self.shell: Any = None

    # -- counting fit (local) -------------------------------------------------
    def install_counter(self) -> None:
        import keras

        original = keras.Model.fit
        recorder = self

        @functools.wraps(original)
        def fit(model: Any, *args: Any, **kwargs: Any) -> Any:
            recorder.fit_calls += 1
            return original(model, *args, **kwargs)

        keras.Model.fit = fit

    # -- the magic around a test's body (nbdist) -----------------------------------
    def magic_shell(self) -> Any:
        if self.shell is None:
            from IPython.core.interactiveshell import InteractiveShell

            self.shell = InteractiveShell.instance()
            self.shell.run_line_magic("load_ext", "nbdist")
        return self.shell

    def run_under_magic(self, item: Any, runtest: Any) -> None:
        shell = self.magic_shell()
        ns = shell.user_ns
        outcome: dict[str, Any] = {}
        recorder = self

        def body() -> None:
            import keras

            intercepted = keras.Model.fit

            @functools.wraps(intercepted)
            def counted(model: Any, *args: Any, **kwargs: Any) -> Any:
                recorder.fit_calls += 1
                return intercepted(model, *args, **kwargs)

            keras.Model.fit = counted  # the magic restores Keras' own fit when the cell ends
            try:
                runtest()
            except BaseException as exc:  # the test's verdict, raised again after the magic returns
                outcome["error"] = exc

        ns["_keras_suite_body"] = body
        try:
            shell.run_cell_magic("dist_train", MAGIC_LINE, "_keras_suite_body()")
        except BaseException as exc:  # the magic's own word after the cell: recorded, not the verdict
            self.after.append(one_line(exc))
        finally:
            for name in ("_keras_suite_body", "history", "history_job"):
                ns.pop(name, None)
        if "error" in outcome:
            raise outcome["error"]


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


RECORDER: Recorder | None = None


def pytest_configure(config: Any) -> None:
    global RECORDER
    RECORDER = Recorder(config)
    if RECORDER.mode == "local":
        RECORDER.install_counter()
    else:
        send_test_cases_by_name()


def _test_case_by_name(self: Any, protocol: int) -> Any:
    return (type(self), (self._testMethodName,))


def send_test_cases_by_name() -> None:
    """Keras' tests assert inside their models and losses (``self.assertEqual`` in a loss, ``test_self``
    in a train_step), so the model sent to a worker refers to the running TestCase, which holds
    pytest's state (files, generators) no notebook has. It travels as its class and test name: the
    worker imports the test module from the checkout and makes a fresh TestCase to assert with."""
    import unittest

    unittest.TestCase.__reduce_ex__ = _test_case_by_name  # type: ignore[method-assign]


def stable_id(nodeid: str) -> str:
    """A test id the same in both runs: parametrized ids that print an object's address (sklearn's estimator
    checks) name it without the address."""
    return re.sub(r"0x[0-9a-f]+", "0x", nodeid)


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    assert RECORDER is not None
    if RECORDER.only is None:
        return
    keep = [item for item in items if stable_id(item.nodeid) in RECORDER.only]
    drop = [item for item in items if stable_id(item.nodeid) not in RECORDER.only]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: Any) -> None:
    assert RECORDER is not None
    RECORDER.fit_calls = 0
    RECORDER.after = []
    if RECORDER.mode == "nbdist":
        runtest = item.runtest
        item.runtest = functools.partial(RECORDER.run_under_magic, item, runtest)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: Any, call: Any) -> Any:
    result = yield
    report = result.get_result()
    assert RECORDER is not None
    entry = RECORDER.results.setdefault(stable_id(item.nodeid), {"outcome": "passed", "fit_calls": 0, "reason": ""})
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr)
        if not entry["reason"]:
            entry["reason"] = (message.strip().splitlines() or ["?"])[0][:300]
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"
    if report.when == "call":
        entry["fit_calls"] = RECORDER.fit_calls
        entry["after"] = list(RECORDER.after)


def pytest_sessionfinish(session: Any) -> None:
    assert RECORDER is not None
    if RECORDER.path:
        with open(RECORDER.path, "w") as f:
            json.dump({"mode": RECORDER.mode, "results": RECORDER.results}, f, indent=1, sort_keys=True)

