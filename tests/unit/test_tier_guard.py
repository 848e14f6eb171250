"""The unit tier's guard (tests/unit/conftest.py) refuses every way a test could start a process or a JVM."""
from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

from .conftest import ProcessInUnitTest


@pytest.mark.parametrize("start", [
    lambda: subprocess.run(["true"], check=False),
    lambda: subprocess.Popen(["true"]),
    lambda: os.system("true"),
    lambda: os.fork() or os._exit(0),  # should the guard fail, the child ends at once
    lambda: os.posix_spawn("/bin/true", ["true"], {}),
    lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
    lambda: multiprocessing.get_context("fork").Process(target=print).start(),
], ids=["subprocess.run", "Popen", "os.system", "os.fork", "posix_spawn", "multiprocessing-spawn",
        "multiprocessing-fork"])
def test_starting_a_process_fails_the_unit_test_with_where_to_move_it(start, no_processes_no_jvm):
    with pytest.raises(ProcessInUnitTest, match="move this test to tests/workers/"):
        start()
    assert no_processes_no_jvm  # recorded too: a refusal swallowed by the code under test still fails it
    no_processes_no_jvm.clear()  # this test expected it


def test_starting_a_spark_jvm_is_refused(no_processes_no_jvm):
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    with pytest.raises(ProcessInUnitTest):  # spark-submit is a process: refused before any JVM exists
        SparkSession.builder.master("local[1]").getOrCreate()
    no_processes_no_jvm.clear()
