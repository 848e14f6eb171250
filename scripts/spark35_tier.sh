#!/usr/bin/env bash
# The Spark 3.5 tier: the Spark tests that reach PySpark's API (barrier and ordinary stages, RDDs, Arrow
# streams, prediction with ML Vectors, partitions) on PySpark 3.5, the oldest nbdist runs on and the Spark of
# EMR 7, Dataproc 2.2 and Databricks 15.4 LTS. A venv holding only pyspark 3.5 and its py4j, whose site also
# reads the test venv's packages: the same Keras, numpy and nbdist, another Spark.
# Usage: scripts/spark35_tier.sh [test venv's python]   (default .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
SPARK=3.5.9
PY4J=0.10.9.7  # the one pyspark 3.5 pins
OUT=$PWD/build/spark35
rm -rf "$OUT"
start=$(date +%s)
"$PY" -m venv "$OUT"
"$OUT/bin/pip" install --quiet --disable-pip-version-check --no-deps "pyspark==$SPARK" "py4j==$PY4J" \
  2> >(grep -v "is neither a file nor a directory" >&2)
SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "import site; site.addsitedir('$SITE')" > "$("$OUT/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz_tests.pth"
"$OUT/bin/python" -c "import pyspark, sys; assert pyspark.__version__ == '$SPARK', pyspark.__version__"
echo "spark 3.5 tier: pyspark $SPARK installed in $(( $(date +%s) - start )) s"
"$OUT/bin/python" -m pytest -q -rs -p no:cacheprovider tests/spark/test_spark_local.py \
  tests/spark/test_spark_stream.py tests/spark/test_spark_inference.py tests/spark/test_spark_partitions.py
echo "spark 3.5 tier: $(( $(date +%s) - start )) s in all"
rm -rf "$OUT"
