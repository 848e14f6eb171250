"""Zeppelin's Spark interpreter's ``sc``, ``spark`` and ``sqlContext`` are found as a Jupyter notebook's are.

Zeppelin (spark/interpreter/.../python/zeppelin_ipyspark.py) does not build them with the builder: it wraps the
JVM's context in a Python SparkContext through its py4j gateway, then a SparkSession around the JVM's session,
and puts them in the kernel's namespace. Here the same is done around a local[2] session's JVM objects.
"""
from __future__ import annotations


def test_zeppelins_spark_objects_are_the_active_session(spark):
    from pyspark import SparkConf, SparkContext
    from pyspark.sql import SparkSession, SQLContext

    from nbdist.config import TrainConfig
    from nbdist.driver.resolve import resolve_backend
    from nbdist.spark.backend import active_spark_context, active_spark_session

    own = spark.sparkContext
    jsc, gateway, jsession = own._jsc, own._gateway, spark._jsparkSession
    # What zeppelin_ipyspark.py runs in the kernel, given the JVM's context and session.
    SparkContext._active_spark_context = None  # a new kernel's Python has none yet
    SparkSession._instantiatedSession = None
    SparkSession._activeSession = None
    conf = SparkConf(_jvm=gateway.jvm, _jconf=jsc.getConf())
    namespace = {"sc": SparkContext(jsc=jsc, gateway=gateway, conf=conf)}
    namespace["spark"] = SparkSession(namespace["sc"], jsession)
    namespace["sqlContext"] = SQLContext._get_or_create(namespace["sc"])
    try:
        assert active_spark_context() is namespace["sc"]
        found = active_spark_session()
        assert found is not None and found._jsparkSession.equals(jsession)
        assert resolve_backend(TrainConfig()).name == "spark"  # --backend auto: Spark, as in Jupyter
    finally:
        SparkContext._active_spark_context = own  # the fixture stops the session it made
        SparkSession._instantiatedSession = spark
        SparkSession._activeSession = spark
