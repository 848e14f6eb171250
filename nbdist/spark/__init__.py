"""Spark: workers as barrier tasks of the notebook's SparkSession (classic or Connect); the data stays there.

backend.py: the Spark backend: the barrier stage, its tasks' reports, stopping exactly its tasks.
task.py: what one barrier task does on its executor: write its partition, start a worker, watch it.
warm.py: warm workers on executors, taken by the next job's tasks (runs on the executor).
balance.py: equal shares of the rows for the workers, whatever the partitioning.
data.py: training data that lives on the executors: a DataFrame or an RDD of (features, label).
checks.py: Spark data checked before evaluation or prediction (feature widths, label classes).
predict.py: prediction inside Spark's Python workers (``DataFrame.mapInPandas``).
cluster.py: executors registered with enough slots, and a driver address they reach.
"""
