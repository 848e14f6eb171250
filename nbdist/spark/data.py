"""Training data that lives on Spark executors: a DataFrame or an RDD of (features, label).

A DataFrame's columns are named: features, a label, and optionally a weight column whose values are
each row's ``sample_weight`` (it travels with its row to the worker that trains or evaluates it).

The driver never collects rows: the backend counts the rows of each partition (balance.py), gives the
data one partition per worker with equal shares, and each task reports its own partition's rows.
pyspark is imported lazily: this module is importable without it.
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ..errors import NbdistError
from .cluster import check_spark_version
from .task import Layout


def is_spark_dataframe(obj: Any) -> bool:
    """A classic or a Spark Connect DataFrame (whose ``rdd`` raises, so it is not probed)."""
    kind = type(obj)
    return kind.__module__.startswith("pyspark.sql") and kind.__name__ == "DataFrame"


def is_spark_rdd(obj: Any) -> bool:
    if "pyspark" not in sys.modules:
        return False
    from pyspark import RDD

    return isinstance(obj, RDD)


def is_spark_data(obj: Any) -> bool:
    return is_spark_dataframe(obj) or is_spark_rdd(obj)


def is_pandas_on_spark(obj: Any) -> bool:
    """A pandas-on-Spark DataFrame (``pyspark.pandas``, ``df.pandas_api()``)."""
    kind = type(obj)
    return kind.__module__.startswith("pyspark.pandas") and kind.__name__ == "DataFrame"


def named_frames(x: Any, validation_data: Any, features: Any, label: Any) -> tuple[Any, Any]:
    """``x`` and ``validation_data`` (alone or first in a tuple) with each pandas-on-Spark DataFrame, when columns
    are named (``features``, ``label``), as the Spark DataFrame behind it (``to_spark()``, its index left out): it
    is then read where it lies. Without names it stays pandas-like data, read into the notebook as ``model.fit``
    reads it."""
    if features is None and label is None:
        return x, validation_data

    def frame(obj: Any) -> Any:
        return obj.to_spark() if is_pandas_on_spark(obj) else obj

    if isinstance(validation_data, (tuple, list)) and validation_data:
        validation_data = type(validation_data)([frame(validation_data[0]), *validation_data[1:]])
    return frame(x), frame(validation_data)


def _names(features: str | Sequence[str] | None) -> tuple[str, ...]:
    if features is None:
        return ()
    if isinstance(features, str):
        return tuple(n.strip() for n in features.split(",") if n.strip())
    return tuple(features)


class SparkData:
    """Rows on the executors plus how to turn them into (x, y).

    Each barrier task reports the rows of the partition it read (``SparkBackend.partition_rows``), so
    the shards are sized from the data trained on, even for a DataFrame that is recomputed differently
    each time (uncached, nondeterministic); the counts taken to balance the shares only route rows.
    """

    def __init__(self, rdd: Any, layout: Layout, dataframe: Any = None) -> None:
        self.rdd = rdd  # an RDD of (features, label) pairs (classic sessions), else None
        self.layout = layout
        self.dataframe = dataframe  # the selected columns, when the source is a DataFrame
        # A validation DataFrame with the same columns (spark_validation): each task writes its share too.
        self.validation: Any = None
        # Partitions whose row counts differ by less than this are read as they are (balance.balanced);
        # the run sets it to the workers' batch size.
        self.batch = 1


def barrier_safe(jrdd: Any) -> bool:
    """Whether a barrier stage can run on this (JVM) RDD as it is.

    Spark refuses a barrier stage whose RDDs, back to the previous shuffle, differ in
    partition count (a union, a coalesce: SPARK-24820); such data needs a repartition.
    """
    want = jrdd.getNumPartitions()
    stack, seen = [jrdd], 0
    while stack and seen < 1000:  # a lineage walk, bounded for pathological plans
        rdd = stack.pop()
        seen += 1
        if rdd.getNumPartitions() != want:
            return False
        deps = rdd.dependencies()
        for i in range(deps.size()):
            dep = deps.apply(i)
            if not dep.getClass().getSimpleName().startswith("Shuffle"):  # narrow: same stage
                stack.append(dep.rdd())
    return True


def spark_dataset(x: Any, y: Any, features: str | Sequence[str] | None, label: str | None,
                  label_required: bool = True, weight_col: str | None = None) -> SparkData:
    """Check a DataFrame/RDD and the column names against it (on the driver: schema only).

    ``label_required=False`` (prediction) accepts a DataFrame with feature columns only. ``weight_col``
    names a numeric column whose values are each row's ``sample_weight``, as in ``model.fit``/``evaluate``.
    """
    import pyspark

    check_spark_version(pyspark.__version__)
    if y is not None:
        raise NbdistError("with Spark data, pass the DataFrame or RDD alone (--data df) and name its columns "
                          "with --features and --label, not a second variable.")
    if is_spark_rdd(x):
        if features or label or weight_col:
            raise NbdistError("--features, --label and --weight-col name DataFrame columns; an RDD must hold "
                              "(features, label) pairs, so drop them (or convert the RDD to a DataFrame).")
        return SparkData(x, Layout())
    cols = _names(features)
    if not label_required and not label:
        if not cols:
            raise NbdistError("a Spark DataFrame needs its feature columns named: add --features COL[,COL...] "
                              "(or features=[...] in the API).")
    elif not cols or not label:
        raise NbdistError("a Spark DataFrame needs its columns named: add --features COL[,COL...] --label COL "
                          "(or features=[...], label=... in nbdist.train).")
    missing = [c for c in (*cols, *([label] if label else [])) if c not in x.columns]
    if missing:
        raise NbdistError(f"the DataFrame has no column {missing[0]!r}; its columns are {', '.join(x.columns)}.")
    from pyspark.sql import types as T

    fields = {f.name: f.dataType for f in x.schema.fields}
    for c in cols:
        t = fields[c]
        ok = isinstance(t, T.NumericType) or (isinstance(t, T.ArrayType) and isinstance(t.elementType, T.NumericType)) \
            or t.typeName() == "vector" or type(t).__name__ == "VectorUDT"
        if not ok:
            raise NbdistError(f"feature column {c!r} is {t.simpleString()}; use numeric, array-of-numbers or "
                              "ML Vector columns (e.g. cast it, or assemble it with VectorAssembler).")
    if not label:
        return SparkData(None, Layout(cols, None), dataframe=x.select(*cols))
    t = fields[label]
    if not isinstance(t, T.NumericType) and not vector_label(x, label):
        raise NbdistError(f"label column {label!r} is {t.simpleString()}, not a number or an array of numbers; "
                          "index it first (e.g. pyspark.ml.feature.StringIndexer).")
    if not weight_col:
        return SparkData(None, Layout(cols, label), dataframe=x.select(*cols, label))
    check_weight_column(x, cols, label, weight_col)
    return SparkData(None, Layout(cols, label, weight_col), dataframe=x.select(*cols, label, weight_col))


def check_weight_column(df: Any, features: Sequence[str], label: str, weight_col: Any) -> None:
    """The weight column (``--weight-col``): one numeric column of ``df``, neither a feature nor the label."""
    if not isinstance(weight_col, str):
        raise NbdistError(f"weight_col names one DataFrame column, e.g. weight_col='w', not {weight_col!r}.")
    if weight_col in features or weight_col == label:
        role = "the label" if weight_col == label else "a feature column"
        raise NbdistError(f"weight column {weight_col!r} is also {role}; name a separate column of per-row "
                          "weights with --weight-col (weight_col=...).")
    if weight_col not in df.columns:
        raise NbdistError(f"the DataFrame has no weight column {weight_col!r}; its columns are "
                          f"{', '.join(df.columns)}.")
    T = sql_types()
    t = {f.name: f.dataType for f in df.schema.fields}[weight_col]
    if not isinstance(t, T.NumericType):
        raise NbdistError(f"weight column {weight_col!r} is {t.simpleString()}, not a number; cast it "
                          f"(e.g. df.withColumn({weight_col!r}, F.col({weight_col!r}).cast('float'))).")


def vector_label(df: Any, label: str | None) -> bool:
    """Whether ``df``'s label column holds arrays of numbers or ML Vectors (one-hot, multi-label, several
    regression targets): (rows, k) labels, trained and evaluated as the same arrays in numpy are."""
    if not label:
        return False
    T = sql_types()
    t = {f.name: f.dataType for f in df.schema.fields}.get(label)
    return (isinstance(t, T.ArrayType) and isinstance(t.elementType, T.NumericType)) \
        or type(t).__name__ == "VectorUDT"


def spark_validation(train: SparkData, validation: Any) -> Any:
    """``validation_data`` given as a Spark DataFrame (alone, or as ``(df,)``/``(df, None)`` from
    ``--validation-data df``), checked against the training DataFrame: the same named columns of the
    same types, so each task can write its share beside its training rows. Its selected columns."""
    if isinstance(validation, (tuple, list)):
        if not validation or not is_spark_data(validation[0]) or any(v is not None for v in validation[1:]):
            raise NbdistError("a Spark DataFrame as validation data goes alone, labels included: "
                              "validation_data=val_df (--validation-data val_df), its columns named as the "
                              "training DataFrame's by --features and --label.")
        validation = validation[0]
    if train.dataframe is None or not is_spark_dataframe(validation):
        raise NbdistError("validation data as Spark data needs a Spark DataFrame for both training and "
                          "validation (an RDD cannot be streamed beside another); pass DataFrames, or numpy "
                          "validation data.")
    layout = train.layout
    if layout.weight is not None and layout.weight not in validation.columns:
        # As model.fit's validation_data=(x_val, y_val) beside a sample_weight: every validation row weighs 1.
        from pyspark.sql import functions as F

        kind = {f.name: f.dataType for f in train.dataframe.schema.fields}[layout.weight]
        validation = validation.withColumn(layout.weight, F.lit(1).cast(kind))
    checked = spark_dataset(validation, None, list(layout.features), layout.label, weight_col=layout.weight)
    want = {f.name: f.dataType for f in train.dataframe.schema.fields}
    for f in checked.dataframe.schema.fields:
        if f.dataType != want[f.name]:
            raise NbdistError(f"validation DataFrame column {f.name!r} is {f.dataType.simpleString()} but the "
                              f"training DataFrame's is {want[f.name].simpleString()}; cast one to the other "
                              f"(e.g. val_df.withColumn({f.name!r}, F.col({f.name!r}).cast(...))).")
    return checked.dataframe


def sql_types() -> Any:
    """``pyspark.sql.types``, for callers outside this package (only nbdist.spark imports pyspark)."""
    from pyspark.sql import types

    return types
