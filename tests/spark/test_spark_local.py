"""The Spark backend on local[2]: DataFrame training, numpy on Spark, a killed worker."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from ..spark_helpers import accuracy, digits_frame, need_spark, small_model, wait_until_no_workers

need_spark()

import nbdist  # noqa: E402
from nbdist.api import prepare  # noqa: E402
from nbdist.config import TrainConfig  # noqa: E402
from nbdist.errors import NbdistError, TrainingFailed  # noqa: E402

EPOCHS = 30
# Averaging 2 workers that each take batches of 32 approximates one machine taking batches of 64
# (exact for K=1 and SGD): that is the single-machine run with the same settings.
LOCAL_BATCH = 64


@pytest.fixture(scope="module")
def local_accuracy(data):
    Xtr, Xte, ytr, yte = data
    model = small_model()
    model.fit(Xtr, ytr, epochs=EPOCHS, batch_size=LOCAL_BATCH, verbose=0)
    return accuracy(model, Xte, yte)


@pytest.mark.full
def test_dataframe_training_matches_local_fit(spark, data, local_accuracy):
    """Averaging on a local[2] DataFrame, 30 epochs, within a point of one machine with the same settings.

    Marked full: CI checks each of its parts elsewhere. A DataFrame's averaging run on local[2] equals the
    in-memory averaging run to 1e-5, every row trained (test_spark_stream.py's
    test_streamed_equals_in_memory_without_shuffle[averaging]); averaging on a Spark DataFrame within a
    point of the local fit is test_spark_connect.py's test_both_strategies_match_local_fit_and_warm_workers_
    serve_the_second_run, and on local workers test_training.py's
    test_accuracy_two_workers_within_one_point_of_local; the workers gone after a Spark run,
    test_killed_worker_fails_fast_and_leaves_nothing here and test_rdd_of_pairs_trains_on_spark.
    """
    Xtr, Xte, ytr, yte = data
    df = digits_frame(spark, Xtr, ytr)
    model = small_model()
    job = nbdist.train(model, df, features="pixels", label="digit", epochs=EPOCHS, batch_size=32,
                       strategy="averaging", workers=2,
                       seed=0)  # backend auto: the active SparkContext
    assert job.status == "done" and job.state.backend == "spark"
    assert len(job.history["loss"]) == EPOCHS
    assert sum(w.samples for w in job.state.workers) == len(Xtr)
    got = accuracy(model, Xte, yte)
    # Not more than 1 point below one machine; the two runs shuffle differently, so a higher
    # score (seen: +1.1 points) is noise in nbdist's favour, not a regression.
    assert got >= local_accuracy - 0.01, (got, local_accuracy)
    assert not wait_until_no_workers(job)


def test_rdd_of_pairs_trains_on_spark(spark, data):
    Xtr, Xte, ytr, yte = data
    model = small_model()
    rdd = spark.sparkContext.parallelize(list(zip(Xtr.tolist(), ytr.tolist())), 3)  # repartitioned to 2
    job = nbdist.train(model, rdd, epochs=4, workers=2, backend="spark")
    assert job.status == "done"
    assert sum(w.samples for w in job.state.workers) == len(Xtr)
    assert min(w.samples for w in job.state.workers) > 0
    assert accuracy(model, Xte, yte) > 0.5  # learning, not chance (0.1)
    assert not wait_until_no_workers(job)


def test_bad_columns_are_one_sentence(spark, data):
    Xtr, _, ytr, _ = data
    df = digits_frame(spark, Xtr[:20], ytr[:20])
    model = small_model()
    with pytest.raises(NbdistError, match="no column 'pixel'"):
        nbdist.train(model, df, features="pixel", label="digit")
    with pytest.raises(NbdistError, match="--features"):
        nbdist.train(model, df)
    with pytest.raises(NbdistError, match="3 workers need 3 Spark task slots"):
        nbdist.train(model, df, features="pixels", label="digit", workers=3)
    # ML Vector and numeric columns pass the schema check; text does not.
    from pyspark.ml.linalg import Vectors

    from nbdist.spark.data import spark_dataset

    mixed = spark.createDataFrame([(Vectors.dense([1.0, 2.0]), 0.5, "a", 1)], ["v", "n", "s", "y"])
    assert spark_dataset(mixed, None, ["v", "n"], "y").layout.features == ("v", "n")
    with pytest.raises(NbdistError, match="feature column 's' is string"):
        spark_dataset(mixed, None, "v,s", "y")
    with pytest.raises(NbdistError, match="label column 's' is string"):
        spark_dataset(mixed, None, "v", "s")


def test_killed_worker_fails_fast_and_leaves_nothing(spark, data):
    # Numpy data this time: it travels over the wire to workers hosted by Spark tasks.
    Xtr, _, ytr, _ = data
    model = small_model()
    before = model.get_weights()
    config = TrainConfig(epochs=500, batch_size=8, workers=2, backend="spark", ui="none")
    job = prepare(model, config, Xtr, ytr, None).start()
    deadline = time.monotonic() + 240
    while job.state.epochs_done < 1:
        assert time.monotonic() < deadline, "training did not start"
        job.pump(0.2)
    victim = next(w for w in job._handles if w.rank == 1)
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(TrainingFailed) as info:
        job.wait(timeout=60)
    elapsed = time.monotonic() - killed_at
    assert elapsed < 15, elapsed
    assert "worker 1" in str(info.value) and "SIGKILL" in str(info.value)
    assert job.status == "failed" and job.state.backend == "spark"
    # Nothing hangs and no worker process survives its task.
    assert not wait_until_no_workers(job)
    # Spark is still usable afterwards: the job group was ended, not the context.
    assert spark.sparkContext.parallelize(range(10), 2).sum() == 45
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))  # failed: model untouched


def _needs_a_missing_package(rows):
    import nbdist_missing_package  # noqa: F401  (as the executors' Python lacking pyarrow fails mapInArrow)

    yield from rows


def test_a_package_the_executors_python_lacks_is_one_sentence_not_a_lost_task(spark):
    """A barrier stage whose tasks' Python cannot import a package (the executors run another environment than
    the notebook's): what Spark reports is a failed barrier task, which nbdist took for a lost one ("its Python
    process or executor died", and relaunched under --max-restarts); it names the package and PYSPARK_PYTHON."""
    from nbdist.spark.backend import SparkBackend, SparkTaskWorker

    backend = SparkBackend(spark, TrainConfig(backend="spark"))
    backend.workers = [SparkTaskWorker(0), SparkTaskWorker(1)]
    backend._run(spark.sparkContext.parallelize([0, 1], 2).barrier().mapPartitions(_needs_a_missing_package).collect)
    for w in backend.workers:
        assert w.code == 1 and not w.lost, (w.code, w.lost, w.spark_error)
        said = w.describe()
        assert "the executors cannot import nbdist_missing_package: they run the Python named by PYSPARK_PYTHON" \
            in said and "\n" not in said, said
    assert spark.sparkContext.parallelize(range(10), 2).sum() == 45


def test_search_runs_two_trials_at_once_on_spark_prunes_and_stores_merged_metrics(spark, data, tmp_path):
    """%%dist_tune's API on local[2]: 4 trials, 2 at once, each trial one worker in a Spark task. The two that
    learn complete with their run's merged metric at the last epoch; the two that cannot are pruned by the
    median pruner before their last epoch, their Spark workers gone; the best model is the best trial's."""
    optuna = pytest.importorskip("optuna")
    Xtr, Xte, ytr, yte = data
    storage = f"sqlite:///{tmp_path / 'spark.db'}"
    study = optuna.create_study(storage=storage, study_name="lr", direction="maximize")
    for lr in (0.01, 0.02, 1e-6, 1e-6):
        study.enqueue_trial({"lr": lr})

    def build(trial):
        model = small_model(trial.number)
        lr = model.optimizer.learning_rate = trial.suggest_float("lr", 1e-6, 0.1, log=True)
        # The median pruner decides only once trials 0 and 1 are complete; the two that cannot learn may start
        # as soon as one of those ends, so they get room to be pruned in (the other may end seconds later on
        # a loaded machine, when 3 epochs of theirs had already finished).
        model.fit(Xtr, ytr, batch_size=64, epochs=3 if lr > 1e-3 else 40, validation_data=(Xte, yte), verbose=0)

    search = nbdist.tune(build, trials=4, parallel=2, objective="val_accuracy", backend="spark", storage=storage,
                         study_name="lr", pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=0))
    trials = {t.number: t for t in search.study.get_trials()}
    states = optuna.trial.TrialState
    assert [trials[n].state for n in range(4)] == [states.COMPLETE, states.COMPLETE, states.PRUNED, states.PRUNED]
    rows = search.state.trials
    # Two at once: each of the first two trials was in flight (its Spark job submitted) before the other ended.
    # Their workers' connection times are not compared: a cold Spark worker on a loaded 2-core machine may take
    # longer to start than the other trial's 3 epochs (CI, stop 51).
    assert rows[1].started < rows[0].ended and rows[0].started < rows[1].ended
    for n in range(4):
        job = search.jobs[n]
        assert job.state.backend == "spark" and not wait_until_no_workers(job)
        if n < 2:
            assert job.status == "done" and trials[n].value == job.history["val_accuracy"][-1]
        else:
            assert job.status == "stopped" and rows[n].epochs_done < rows[n].epochs == 40
    assert search.best_model is search.jobs[search.study.best_trial.number].model
    assert accuracy(search.best_model, Xte, yte) == pytest.approx(search.study.best_value, abs=1e-6)
