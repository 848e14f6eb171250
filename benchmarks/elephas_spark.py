"""The SparkContext both Elephas scripts train on (run in Elephas's own venv; imports nothing from nbdist):
local[N] on loopback, no UI, the workers on this venv's Python, as nbdist's side of the rows is run."""
from __future__ import annotations

import os
import sys
from typing import Any


def local_spark_context(workers: int, app: str) -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark import SparkConf, SparkContext

    conf = (SparkConf().setMaster(f"local[{workers}]").setAppName(app)
            .set("spark.ui.enabled", "false").set("spark.ui.showConsoleProgress", "false")
            .set("spark.driver.host", "127.0.0.1").set("spark.pyspark.python", sys.executable))
    sc = SparkContext(conf=conf)
    sc.setLogLevel("ERROR")
    return sc
