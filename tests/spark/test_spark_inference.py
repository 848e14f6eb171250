"""Issue 6 on Spark (local[2]): evaluate partitions where they live, predict into a new DataFrame.

Evaluation data is a DataFrame with two partitions of unequal size (100 and 260 rows),
so the merged metrics must be exact, not an average of per-partition scores.
"""
from __future__ import annotations

import numpy as np
import pytest

from ..spark_helpers import need_spark

need_spark()

import keras  # noqa: E402
from sklearn.metrics import (  # noqa: E402
    accuracy_score,
    confusion_matrix,
    f1_score,
    precision_recall_fscore_support,
    precision_score,
    recall_score,
    roc_auc_score,
)

import nbdist  # noqa: E402
from nbdist.errors import NbdistError  # noqa: E402

from ..conftest import ipython_shell  # noqa: E402

TOL = 1e-6
SMALL = 100  # rows in the first partition; the rest (260) in the second


@pytest.fixture(scope="module")
def multiclass(data):
    Xtr, _, ytr, _ = data
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(Xtr, ytr, epochs=3, batch_size=32, verbose=0)
    return model


@pytest.fixture(scope="module")
def binary(data):
    """Is the digit 5 or more? A sigmoid model with thresholded and exact-AUC metrics."""
    Xtr, _, ytr, _ = data
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1, activation="sigmoid")])
    model.compile(keras.optimizers.Adam(0.01), "binary_crossentropy",
                  metrics=["accuracy", keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision"),
                           keras.metrics.Recall(name="recall")])
    model.fit(Xtr, (ytr >= 5).astype("float32"), epochs=2, batch_size=32, verbose=0)
    return model


def unequal_frame(spark, X, y):
    """Rows with an id, in two partitions of 100 and len(X) - 100 rows (a shuffle, so barrier-safe)."""
    rows = [(i, x.tolist(), int(label)) for i, (x, label) in enumerate(zip(X, y))]
    rdd = (spark.sparkContext.parallelize(rows, 3).keyBy(lambda r: 0 if r[0] < SMALL else 1)
           .partitionBy(2, lambda k: k).values())
    return spark.createDataFrame(rdd, "id long, pixels array<float>, digit long")


@pytest.fixture(scope="module")
def test_frame(spark, data):
    _, Xte, _, yte = data
    df = unequal_frame(spark, Xte, yte).cache()
    sizes = df.rdd.glom().map(len).collect()  # the test's own check, not nbdist's code path
    assert sizes == [SMALL, len(Xte) - SMALL]
    return df


def test_magic_evaluates_dataframe_exactly(spark, data, multiclass, test_frame, no_leftover_workers):
    _, Xte, _, yte = data
    shell = ipython_shell()
    shell.user_ns.update(model=multiclass, test_df=test_frame)
    before = [w.copy() for w in multiclass.get_weights()]
    shell.run_line_magic("dist_evaluate", "model --data test_df --features pixels --label digit --workers 2 "
                                          "--out ev")
    result = shell.user_ns["ev"]
    local = multiclass.evaluate(Xte, yte, batch_size=256, verbose=0, return_dict=True)
    assert result["samples"] == len(Xte)
    assert result["loss"] == pytest.approx(local["loss"], abs=TOL)
    assert result["accuracy"] == pytest.approx(local["accuracy"], abs=TOL)
    pred = multiclass.predict(Xte, verbose=0).argmax(axis=1)
    np.testing.assert_array_equal(result["confusion_matrix"], confusion_matrix(yte, pred, labels=range(10)))
    p, r, f, s = precision_recall_fscore_support(yte, pred, labels=range(10), zero_division=0)
    for c in range(10):
        got = result["per_class"][c]
        assert (got["precision"], got["recall"], got["f1"], got["support"]) == pytest.approx((p[c], r[c], f[c], s[c]),
                                                                                            abs=TOL)
    assert result["averages"]["macro_f1"] == pytest.approx(f1_score(yte, pred, average="macro"), abs=TOL)
    assert 0.5 < result["accuracy"] < 1.0  # a learned model, so equality means something
    for a, b in zip(before, multiclass.get_weights()):
        np.testing.assert_array_equal(a, b)


@pytest.mark.full("evaluate on a DataFrame: test_magic_evaluates_dataframe_exactly; AUC's merged counts: "
                  "tests/workers/test_evaluate.py's binary classifier test")
def test_binary_metrics_on_dataframe_equal_keras_and_sklearn(spark, data, binary, test_frame, no_leftover_workers):
    _, Xte, _, yte = data
    yb = (yte >= 5).astype("float32")
    from pyspark.sql import functions as F

    df = test_frame.withColumn("big", (F.col("digit") >= 5).cast("double"))
    result = nbdist.evaluate(binary, df, features=["pixels"], label="big", workers=2, batch_size=64)
    local = binary.evaluate(Xte, yb, batch_size=64, verbose=0, return_dict=True)
    for name in ("loss", "accuracy", "auc", "precision", "recall"):
        assert result[name] == pytest.approx(local[name], abs=TOL), name
    scores = binary.predict(Xte, verbose=0)[:, 0]
    pred = scores > 0.5
    avg = result["averages"]
    assert avg["accuracy"] == pytest.approx(accuracy_score(yb, pred), abs=TOL)
    assert avg["precision"] == pytest.approx(precision_score(yb, pred), abs=TOL)
    assert avg["recall"] == pytest.approx(recall_score(yb, pred), abs=TOL)
    assert avg["f1"] == pytest.approx(f1_score(yb, pred), abs=TOL)
    assert avg["roc_auc"] == pytest.approx(roc_auc_score(yb, scores), abs=TOL)
    assert 0.7 < avg["roc_auc"] < 1.0


def test_predict_adds_a_column_equal_to_local_predict(spark, data, multiclass, binary, test_frame):
    _, Xte, _, _ = data
    out = nbdist.predict(multiclass, test_frame, features="pixels")
    assert out.columns == ["id", "pixels", "digit", "prediction"]
    assert out.rdd.getNumPartitions() == 2  # the input's partitions, nothing gathered
    rows = out.select("id", "prediction").collect()  # collected here by the test, to compare
    assert len(rows) == len(Xte)
    got = np.array([r.prediction for r in sorted(rows, key=lambda r: r.id)])
    np.testing.assert_allclose(got, multiclass.predict(Xte, verbose=0), rtol=0, atol=TOL)
    # One output per row: a double column. ML Vector and numeric columns as features.
    from pyspark.ml.linalg import Vectors

    n = 40
    vec = spark.createDataFrame([(i, Vectors.dense(x[:60].tolist()), *map(float, x[60:]))
                                 for i, x in enumerate(Xte[:n])], ["id", "v", "a", "b", "c", "d"])
    scored = nbdist.predict(binary, vec, features="v,a,b,c,d", prediction_col="p_big")
    assert dict(scored.dtypes)["p_big"] == "double"
    got = np.array([r.p_big for r in sorted(scored.select("id", "p_big").collect(), key=lambda r: r.id)])
    np.testing.assert_allclose(got, binary.predict(Xte[:n], verbose=0)[:, 0], rtol=0, atol=TOL)


def test_magic_predict_returns_a_dataframe(spark, data, binary, test_frame):
    _, Xte, _, _ = data
    shell = ipython_shell()
    shell.user_ns.update(bmodel=binary, test_df=test_frame)
    shell.run_line_magic("dist_predict", "bmodel --data test_df --features pixels --out scored")
    scored = shell.user_ns["scored"]
    first = scored.orderBy("id").select("prediction").first()
    assert first.prediction == pytest.approx(float(binary.predict(Xte[:1], verbose=0)[0, 0]), abs=TOL)


def test_bad_input_is_one_sentence(spark, data, multiclass, test_frame):
    from IPython.core.error import UsageError

    def sentence(exc):
        text = str(exc.value)
        assert "\n" not in text and text.endswith("."), text
        return text

    with pytest.raises(NbdistError, match="no column 'pixel'") as info:
        nbdist.evaluate(multiclass, test_frame, features="pixel", label="digit")
    sentence(info)
    with pytest.raises(NbdistError, match="no column 'label'"):
        nbdist.predict(multiclass, test_frame, features="pixels,label")
    text_df = test_frame.selectExpr("id", "pixels", "cast(digit as string) as name")
    with pytest.raises(NbdistError, match="feature column 'name' is string") as info:
        nbdist.predict(multiclass, text_df, features="pixels,name")
    sentence(info)
    with pytest.raises(NbdistError, match="label column 'name' is string"):
        nbdist.evaluate(multiclass, text_df, features="pixels", label="name")
    # Label shape: a one-hot model cannot take one class id per row.
    onehot = keras.models.clone_model(multiclass)
    onehot.set_weights(multiclass.get_weights())
    onehot.compile("adam", "categorical_crossentropy", metrics=["accuracy"])
    with pytest.raises(NbdistError, match=r"per row but the model outputs \(10,\)") as info:
        nbdist.evaluate(onehot, test_frame, features="pixels", label="digit")
    sentence(info)
    with pytest.raises(NbdistError, match="hold 65 values per row but the model expects 64"):
        nbdist.evaluate(multiclass, test_frame, features="pixels,id", label="digit")
    with pytest.raises(NbdistError, match="whole class ids from 0 to 9"):
        nbdist.evaluate(multiclass, test_frame.withColumn("digit", test_frame.digit + 1), features="pixels",
                        label="digit")
    with pytest.raises(NbdistError, match="already has a column 'digit'"):
        nbdist.predict(multiclass, test_frame, features="pixels", prediction_col="digit")
    with pytest.raises(NbdistError, match="drop --workers"):
        nbdist.predict(multiclass, test_frame, features="pixels", workers=2)
    with pytest.raises(NbdistError, match="drop --backend local"):
        nbdist.evaluate(multiclass, test_frame, features="pixels", label="digit", backend="local")
    with pytest.raises(NbdistError, match="--features COL"):
        nbdist.predict(multiclass, test_frame)
    # Through the magic: a UsageError with the same sentence; the kernel carries on.
    shell = ipython_shell()
    shell.user_ns.update(model=multiclass, test_df=test_frame)
    with pytest.raises(UsageError, match="no column 'pixel'"):
        shell.run_line_magic("dist_predict", "model --data test_df --features pixel --out p")
    with pytest.raises(UsageError, match="--features and --label name the columns"):
        shell.user_ns.update(X=np.zeros((4, 64), np.float32), y=np.zeros(4, np.int64))
        shell.run_line_magic("dist_evaluate", "model --data X,y --features pixels")


def test_union_is_repartitioned_for_barrier_tasks(spark, data):
    # A union's RDD chain has parents with other partition counts, which Spark refuses in a
    # barrier stage (SPARK-24820) even when its partition count equals the workers.
    from nbdist.spark.data import barrier_safe, spark_dataset

    _, Xte, _, yte = data
    rows = [(i, x.tolist(), int(label)) for i, (x, label) in enumerate(zip(Xte[:80], yte[:80]))]
    sc = spark.sparkContext
    union = spark.createDataFrame(sc.parallelize(rows[:50], 1).union(sc.parallelize(rows[50:], 1)),
                                  "id long, pixels array<float>, digit long")
    assert union.rdd.getNumPartitions() == 2 and not barrier_safe(union._jdf.rdd())
    assert spark_dataset(union, None, "pixels", "digit").layout.features == ("pixels",)
    assert barrier_safe(unequal_frame(spark, Xte[:10], yte[:10])._jdf.rdd())
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy")
    model.fit(Xte[:10], yte[:10], epochs=1, verbose=0)
    got = nbdist.evaluate(model, union, features="pixels", label="digit", workers=2)
    assert got["samples"] == 80  # the barrier stage ran: the union was repartitioned (round-robin)


def test_uncached_vector_assembler_frame_trains_and_evaluates(spark, data, no_leftover_workers):
    # The everyday DataFrame: pandas -> createDataFrame -> VectorAssembler, never cached. A count
    # taken in a separate pass does not match what the barrier tasks read ("data changes each
    # time it is computed"); the rows the tasks count themselves do.
    import pandas as pd
    from pyspark.ml.feature import VectorAssembler

    Xtr, Xte, ytr, yte = data
    cols = [f"p{i}" for i in range(64)]

    def frame(X, y):
        pdf = pd.DataFrame(X.astype("float64"), columns=cols)
        pdf["digit"] = y.astype("int64")
        return VectorAssembler(inputCols=cols, outputCol="features").transform(spark.createDataFrame(pdf))

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    job = nbdist.train(model, frame(Xtr, ytr), features="features", label="digit", epochs=4, workers=2, ui="none")
    assert job.status == "done" and sum(w.samples for w in job.state.workers) == len(Xtr)
    got = nbdist.evaluate(model, frame(Xte, yte), features="features", label="digit", workers=2)
    want = model.evaluate(Xte, yte, batch_size=256, verbose=0, return_dict=True)
    assert got["samples"] == len(Xte)
    assert abs(got["loss"] - want["loss"]) < TOL and abs(got["accuracy"] - want["accuracy"]) < TOL
    assert want["accuracy"] > 0.5  # it learned


def test_a_pandas_on_spark_frame_with_named_columns_stays_on_the_executors(spark, data, no_leftover_workers):
    """``df.pandas_api()`` (pandas-on-Spark) with --features/--label is the Spark DataFrame behind it: the tasks
    read its partitions (they count its rows), evaluate merges exactly, predict is a lazy DataFrame."""
    import pandas as pd
    import pyspark

    if pyspark.__version__.startswith("3.") and int(np.__version__.split(".")[0]) >= 2:
        pytest.skip(f"PySpark {pyspark.__version__}'s pandas API uses np.NaN, which NumPy {np.__version__} removed")

    Xtr, Xte, ytr, yte = data
    cols = [f"p{i}" for i in range(64)]

    def frame(X, y):
        pdf = pd.DataFrame(X.astype("float64"), columns=cols)
        pdf["digit"] = y.astype("int64")
        return spark.createDataFrame(pdf).pandas_api()

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    train = frame(Xtr, ytr)
    job = nbdist.train(model, train, features=cols, label="digit", epochs=3, workers=2, ui="none",
                       validation_data=frame(Xte, yte))
    assert job.status == "done" and job._backend.partition_rows() is not None  # read by the tasks
    assert sum(job._backend.partition_rows()) == len(Xtr) and len(job.history["val_loss"]) == 3
    got = nbdist.evaluate(model, frame(Xte, yte), features=cols, label="digit", workers=2)
    want = model.evaluate(Xte, yte, batch_size=256, verbose=0, return_dict=True)
    assert abs(got["loss"] - want["loss"]) < TOL and abs(got["accuracy"] - want["accuracy"]) < TOL
    scored = nbdist.predict(model, frame(Xte, yte), features=cols)
    assert type(scored).__module__.startswith("pyspark.sql") and "prediction" in scored.columns
    assert type(train).__module__.startswith("pyspark.pandas")  # the notebook's frame is left as it was
    shell = ipython_shell()
    shell.user_ns.update(model=model, test_psdf=frame(Xte, yte))
    shell.run_line_magic("dist_evaluate", f"model --data test_psdf --features {','.join(cols)} --label digit "
                                          "--workers 2 --out ev")
    assert shell.user_ns["ev"]["loss"] == pytest.approx(want["loss"], abs=TOL)
