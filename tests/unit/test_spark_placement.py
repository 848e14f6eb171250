"""GPU placement of Spark-hosted allreduce workers, as pure functions (milliseconds, no JVM).

There is no GPU here: these check the decisions (task resources -> CUDA_VISIBLE_DEVICES -> one GPU
per worker), not that NCCL runs; the engine is then the worker's choice with its peers, from the
devices they see (tests/unit/test_allreduce_placement.py).
"""
import pytest

from nbdist.machine.placement import spark_task_visible_devices
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
