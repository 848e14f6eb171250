#!/usr/bin/env bash
# The oldest tier: the floors of pyproject's ranges, beside the test venv's newest releases.
# Keras 3.14 on TensorFlow 2.20 (the Keras contract: the conformance and callback tests), JAX 0.8.1 (a JAX
# notebook's workers and JAX's own collective) and PySpark 3.5, the Spark of EMR 7, Dataproc 2.2 and Databricks
# 15.4 LTS (the Spark modules that reach PySpark's API: barrier and ordinary stages, RDDs, Arrow streams,
# prediction with ML Vectors, partitions). A venv holding only those and py4j, whose site also reads the test
# venv's packages.
# Usage: scripts/oldest_tier.sh [test venv's python]   (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
KERAS=3.14.1
TENSORFLOW=2.20.0
JAX=0.8.1
SPARK=3.5.9
PY4J=0.10.9.7  # the one pyspark 3.5 pins
OUT=$PWD/build/oldest
rm -rf "$OUT"
start=$(date +%s)
"$PY" -m venv "$OUT"
"$OUT/bin/pip" install --quiet --disable-pip-version-check --no-deps "keras==$KERAS" \
  "tensorflow==$TENSORFLOW" "jax==$JAX" \
  "jaxlib==$JAX" "pyspark==$SPARK" "py4j==$PY4J" 2> >(grep -v "is neither a file nor a directory" >&2)
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
OWN=$("$OUT/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$SITE')" > "$OWN/zz_tests.pth"
TF_CPP_MIN_LOG_LEVEL=3 "$OUT/bin/python" -c "import keras, tensorflow as tf, jax, pyspark
got = keras.__version__, tf.__version__, jax.__version__, pyspark.__version__
assert got == ('$KERAS', '$TENSORFLOW', '$JAX', '$SPARK'), got"
echo "oldest tier: keras $KERAS, tensorflow $TENSORFLOW, jax $JAX and pyspark $SPARK installed in" \
     "$(( $(date +%s) - start )) s"
B=tests/workers/test_backends.py
JAX_TESTS=("$B::test_a_notebook_on_jax_or_torch_trains_evaluates_and_predicts_as_locally[jax]"
           "$B::test_the_paths_that_differ_per_backend[jax]" "$B::test_what_users_bring_from_other_apis_trains_as_locally[jax]"
           "$B::test_a_seeded_cell_reproduces_on_jax_and_torch_workers_without_tensorflow[jax]"
           "$B::test_two_jax_workers_sum_inside_the_step_as_the_local_fit_and_a_killed_one_fails_the_run"
           "$B::test_a_jax_worker_on_one_core_takes_large_arrays_into_its_host_callback")
"$OUT/bin/python" -m pytest -q -rs -p no:cacheprovider tests/workers/test_keras_conformance.py \
  tests/workers/test_callback_contract.py "${JAX_TESTS[@]}" tests/spark/test_spark_local.py \
  tests/spark/test_spark_stream.py tests/spark/test_spark_inference.py tests/spark/test_spark_partitions.py
echo "oldest tier: $(( $(date +%s) - start )) s in all"
rm -rf "$OUT"
