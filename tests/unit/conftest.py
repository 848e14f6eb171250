"""Keeps the unit tier honest: a unit test that starts a process or a JVM fails, naming the command.

Unit tests run in seconds with no worker process, no kernel and no Spark. Every way Python
starts a program ends in one of the functions wrapped here (subprocess and multiprocessing
through ``_posixsubprocess.fork_exec`` or ``os.posix_spawn``; ``os.fork`` directly), and
pyspark's JVM is reached only through ``SparkContext._gateway``. After an earlier tier in the
same pytest process has started that gateway, a new SparkContext needs no process: the guard
then refuses ``SparkContext._ensure_initialized`` itself.
"""
from __future__ import annotations

import _posixsubprocess
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

# platform.processor() runs `uname -p` once and caches it; TensorFlow asks for it when imported.
# Asked here, before any guard, so importing TensorFlow inside a unit test starts nothing.
platform.processor()

MOVE = "unit tests start no processes and no JVM: move this test to tests/workers/, tests/spark/ or tests/notebook/"


class ProcessInUnitTest(AssertionError):
    """Raised where a unit test starts a process, so the test fails at the line that did it."""


def _refusing(name: str, started: list[str]) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        what = f"{name}({args[0]!r})" if name == "os.system" else name
        if name in ("fork_exec", "os.posix_spawn", "os.posix_spawnp") and args:
            what = f"{name}({args[0]!r}, ...)"  # the program (fork_exec: its argv)
        started.append(what)
        raise ProcessInUnitTest(f"{what}: {MOVE}")

    return refuse


@pytest.fixture(autouse=True)
def no_processes_no_jvm(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Fails the test if it (or a thread it started) starts a process or a Spark JVM gateway."""
    started: list[str] = []
    # Loading the extension would start a fork server, as a notebook's does: here it starts none.
    monkeypatch.setattr("nbdist.backends.local.start_warm_workers", lambda workers=None: None)
    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refusing("fork_exec", started))
    # subprocess keeps its own reference to fork_exec, taken when it was imported.
    monkeypatch.setattr(subprocess, "_fork_exec", _refusing("fork_exec", started), raising=False)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, _refusing(f"os.{name}", started))
    context = _spark_context_class()
    if context is not None:  # an earlier tier's JVM gateway is reused without a process: refuse the context itself
        refuse_context = _refusing("SparkContext", started)
        monkeypatch.setattr(context, "_ensure_initialized", classmethod(lambda cls, *a, **k: refuse_context()))
    gateway_before = _spark_gateway()
    yield started
    # A refusal inside a thread (or one a test swallowed) still fails the test here.
    assert not started, f"{started[0]}: {MOVE}"
    if gateway_before is None and _spark_gateway() is not None:
        pytest.fail(f"a Spark JVM gateway was started: {MOVE}")


def _spark_context_class() -> Any:
    module = sys.modules.get("pyspark.core.context")  # only looked at once something imported pyspark
    return getattr(module, "SparkContext", None)


def _spark_gateway() -> Any:
    return getattr(_spark_context_class(), "_gateway", None)
