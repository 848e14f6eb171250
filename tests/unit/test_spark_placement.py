"""GPU placement of Spark-hosted allreduce workers, as pure functions (milliseconds, no JVM).

There is no GPU here: these check the decisions (task resources -> CUDA_VISIBLE_DEVICES ->
one GPU per worker -> NCCL or Gloo), not that NCCL runs. Unverified on a GPU.
"""
import pytest

from nbdist.errors import NbdistError
from nbdist.machine.placement import spark_task_placement, spark_task_visible_devices
from nbdist.spark.task import task_visible_devices


def test_task_gpus_become_one_visible_device_per_worker():
    assert spark_task_visible_devices(None) is None  # Spark schedules no GPUs: the executor's setting stands
    assert spark_task_visible_devices(["3"]) == "3"
    assert spark_task_visible_devices(["2", "5"]) == "2"  # one GPU per worker, as allreduce pins
    assert spark_task_visible_devices([" 1 "]) == "1"
    assert spark_task_visible_devices([]) == ""  # a GPU resource with nothing assigned: hide them all


def test_task_resources_as_spark_hands_them_over():
    pytest.importorskip("pyspark")
    from pyspark.resource import ResourceInformation

    assert task_visible_devices({}) is None
    assert task_visible_devices({"fpga": ResourceInformation("fpga", ["0"])}) is None
    assert task_visible_devices({"gpu": ResourceInformation("gpu", ["1"])}) == "1"
    assert task_visible_devices({"gpu": ResourceInformation("gpu", ["2", "3"])}) == "2"


def test_engine_follows_the_tasks_gpu():
    assert spark_task_placement(["0"], None) == ("0", "nccl", None)
    assert spark_task_placement(["0"], "gloo") == ("0", "gloo", None)
    assert spark_task_placement([], None) == ("", "gloo", None)
    assert spark_task_placement(None, "gloo") == (None, None, None)  # decided on the worker from what it sees
    devices, engine, warning = spark_task_placement(["4"], "horovod", horovod_error="ImportError: no horovod")
    assert (devices, engine) == ("4", "nccl") and "default engine, nccl" in warning
    with pytest.raises(NbdistError, match="--engine nccl needs a GPU"):
        spark_task_placement([], "nccl")
