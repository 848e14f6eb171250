"""Pure parts of the Spark backend: no JVM, milliseconds each."""
from __future__ import annotations

import io

import numpy as np
import pytest

from nbdist.config import TrainConfig
from nbdist.errors import NbdistError
from nbdist.spark.backend import NO_SPARK, coordinator_host, summarize_spark_error
from nbdist.spark.task import Layout, cuda_visible_devices, write_partition
from nbdist.wire.shardfile import load_task_data, npy_header


def test_npy_header_is_fixed_size_and_loadable():
    arr = np.arange(12, dtype=np.float32).reshape(4, 3)
    data = npy_header(arr.dtype, arr.shape) + arr.tobytes()
    assert len(npy_header(np.int64, (10**12, 3072))) == 128
    np.testing.assert_array_equal(np.load(io.BytesIO(data)), arr)


def test_write_partition_reads_numbers_arrays_and_vectors(tmp_path):
    pytest.importorskip("pyspark")
    from pyspark.ml.linalg import DenseVector, SparseVector

    rows = [(1.0, [2, 3], DenseVector([4.0, 5.0]), 7), (8.0, [9, 10], SparseVector(2, {1: 11.0}), 2)] * 5
    n = write_partition(iter(rows), Layout(("a", "b", "v"), "y"), str(tmp_path), chunk=3)
    x, y = load_task_data(str(tmp_path))
    assert n == 10 and x.shape == (10, 5) and x.dtype == np.float32
    np.testing.assert_array_equal(x[1], [8, 9, 10, 0, 11])
    assert y.dtype == np.int64 and list(y[:2]) == [7, 2]


def test_write_partition_reads_pairs(tmp_path):
    rows = [(np.arange(4) * i, float(i % 2)) for i in range(7)]
    assert write_partition(iter(rows), Layout(), str(tmp_path)) == 7
    x, y = load_task_data(str(tmp_path))
    assert x.shape == (7, 4) and y.dtype == np.float32 and y[1] == 1.0


def test_null_feature_is_a_sentence(tmp_path):
    with pytest.raises(ValueError, match="holds nulls"):
        write_partition(iter([(1.0, 1), (None, 0)]), Layout(("a",), "y"), str(tmp_path))


def test_cuda_visible_devices_from_task_resources():
    # No GPU here: ResourceInformation is what Spark hands a task; the mapping is unverified on a GPU.
    pytest.importorskip("pyspark")
    from pyspark.resource import ResourceInformation

    assert cuda_visible_devices({}) is None
    assert cuda_visible_devices({"fpga": ResourceInformation("fpga", ["0"])}) is None
    assert cuda_visible_devices({"gpu": ResourceInformation("gpu", ["1"])}) == "1"
    assert cuda_visible_devices({"gpu": ResourceInformation("gpu", ["2", "3"])}) == "2,3"


def test_coordinator_host():
    assert coordinator_host("local[2]", "10.1.2.3") == "127.0.0.1"
    assert coordinator_host("spark://127.0.0.1:7077", "127.0.0.1") == "127.0.0.1"
    assert coordinator_host("spark://m:7077", "driver", resolve=lambda h: "10.0.0.5") == "10.0.0.5"
    assert coordinator_host("yarn", "localhost", resolve=lambda h: "127.0.1.1") == "127.0.0.1"


def test_spark_errors_are_summarised():
    assert summarize_spark_error(RuntimeError("first line\n\tat org.apache...")) == "first line"
    assert "the executors cannot import nbdist" in summarize_spark_error(
        RuntimeError("ModuleNotFoundError: No module named 'nbdist'"))
    said = summarize_spark_error(RuntimeError("Job aborted\nModuleNotFoundError: No module named 'pyarrow.lib'"))
    assert said.startswith("the executors cannot import pyarrow: ") and "sc.addPyFile" not in said, said


def test_backend_spark_without_spark_is_one_sentence():
    from nbdist.driver.resolve import resolve_backend
    from nbdist.spark.backend import active_spark_context

    if active_spark_context() is not None:
        pytest.skip("a SparkContext is active in this process")
    with pytest.raises(NbdistError) as info:
        resolve_backend(TrainConfig(backend="spark"))
    assert str(info.value) == NO_SPARK and "\n" not in NO_SPARK and "SparkSession.builder" in NO_SPARK
    assert resolve_backend(TrainConfig(backend="auto")).name == "local"


def test_magic_backend_spark_without_spark():
    from IPython.core.error import UsageError

    from nbdist.spark.backend import active_spark_context

    from ..conftest import ipython_shell  # the session's one shell: a second shell class cannot coexist

    if active_spark_context() is not None:
        pytest.skip("a SparkContext is active in this process")
    ip = ipython_shell()
    ip.user_ns.update(X=np.zeros((4, 2), np.float32), y=np.zeros(4, np.int64))
    with pytest.raises(UsageError, match="needs an active SparkContext"):
        ip.run_cell_magic("dist_train", "--data X,y --backend spark", "model = None")


def test_the_failed_barrier_task_is_read_from_sparks_message():
    """Spark aborts a barrier stage when one task fails and cancels the others: the one it names is the
    worker lost with its task; the others were only cancelled with it."""
    from nbdist.spark.backend import failed_barrier_task

    message = ("Job aborted due to stage failure: Could not recover from a failed barrier ResultStage. Most recent "
               "failure reason: Stage failed because barrier task ResultTask(10, 1) finished unsuccessfully.")
    assert failed_barrier_task(message) == 1
    assert failed_barrier_task("Job 3 cancelled because SparkContext was shut down") is None
    assert failed_barrier_task("") is None
