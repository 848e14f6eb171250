"""Issues 16 and 17 on Spark local[2]: a notebook-defined loss with a subclassed model trained from a
DataFrame, and an unchanged cell's own model.fit with callbacks and class_weight."""
from __future__ import annotations

import pytest

from ..models_and_fit import check_intercepted_fit, check_subclassed_run, notebook_subclassed_model
from ..spark_helpers import digits_frame, need_spark

need_spark()

import nbdist  # noqa: E402

EPOCHS = 12


def test_notebook_loss_and_subclassed_model_train_from_a_dataframe(spark, data):
    """Executors get the notebook's loss function and model class by value; the model was built with
    build(), so its layers get their weights only once data is known."""
    Xtr, Xte, ytr, yte = data
    local = notebook_subclassed_model(5)
    # The global batch of 2 workers x 32 under allreduce.
    local.fit(Xtr, ytr, batch_size=64, epochs=EPOCHS, verbose=0)
    model = notebook_subclassed_model(5)
    job = nbdist.train(model, digits_frame(spark, Xtr, ytr), features="pixels", label="digit", epochs=EPOCHS,
                       batch_size=32, workers=2, seed=5, strategy="allreduce", backend="spark", ui="none")
    assert job.status == "done" and job.state.backend == "spark"
    check_subclassed_run(job, model, local, Xte, yte, EPOCHS)


def test_intercepted_fit_with_callbacks_and_class_weight(spark, ip, tmp_path):
    check_intercepted_fit(ip, "--workers 2 --backend spark --strategy allreduce --ui none", tmp_path)


def test_a_dataframe_trains_with_the_notebooks_callbacks(spark, data, tmp_path):
    """The notebook's callbacks act at a DataFrame's epoch ends as at a fit's, on the merged logs of a validation
    DataFrame: EarlyStopping on val_accuracy asking for a gain no epoch can make (min_delta=1) stops after 2 epochs,
    ModelCheckpoint keeps the best epoch's model, CSVLogger writes each epoch."""
    import csv

    import keras

    from ..spark_helpers import small_model

    Xtr, Xte, ytr, yte = data
    model = small_model()
    stop = keras.callbacks.EarlyStopping(monitor="val_accuracy", patience=0, min_delta=1.0)
    best = keras.callbacks.ModelCheckpoint(str(tmp_path / "best.keras"), monitor="val_accuracy", save_best_only=True)
    job = nbdist.train(model, digits_frame(spark, Xtr, ytr), features="pixels", label="digit", epochs=EPOCHS,
                       validation_data=digits_frame(spark, Xte, yte), batch_size=32, workers=2, backend="spark",
                       callbacks=[stop, best, keras.callbacks.CSVLogger(str(tmp_path / "log.csv"))])
    accuracy = job.history["val_accuracy"]
    assert job.status == "done" and len(accuracy) == 2 and job.fit_history.history["val_accuracy"] == accuracy
    with open(tmp_path / "log.csv") as f:
        assert [float(row["val_accuracy"]) for row in csv.DictReader(f)] == pytest.approx(accuracy, rel=1e-6)
    saved = keras.saving.load_model(tmp_path / "best.keras")
    assert saved.evaluate(Xte, yte, verbose=0)[1] == pytest.approx(max(accuracy), abs=1e-6)


def test_a_model_without_an_input_shape_trains_from_a_dataframe(spark, data):
    """Built before launch on a zero row as wide as the feature columns (the rows stay on the executors), so
    the workers' weights have a model to come back into."""
    import keras

    Xtr, Xte, ytr, yte = data
    model = keras.Sequential([keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10, activation="softmax")])
    model.compile("adam", "sparse_categorical_crossentropy", metrics=["accuracy"])
    job = nbdist.train(model, digits_frame(spark, Xtr, ytr), features="pixels", label="digit", epochs=5,
                       batch_size=32, workers=2, backend="spark", ui="none")
    assert job.status == "done" and model.built and model.layers[0].kernel.shape == (64, 32)
    assert float((model.predict(Xte, verbose=0).argmax(1) == yte).mean()) > 0.8


@pytest.mark.full("async on Spark tasks: the PyDataset test below; arrays dealt by batch index: "
                  "tests/workers/test_async.py")
def test_async_trains_arrays_on_spark_tasks(spark, data):
    """Issue 38: --strategy async with the workers as Spark tasks (barrier mode): the arrays travel whole to each
    task, the driver deals batch indices; the model ends on the shared weights the tasks last validated."""
    import keras

    from ..conftest import mlp

    Xtr, Xte, ytr, yte = data
    model = mlp(seed=0, optimizer=keras.optimizers.Adam(0.01))
    job = nbdist.train(model, Xtr, ytr, epochs=3, batch_size=16, workers=2, strategy="async", backend="spark",
                       validation_data=(Xte, yte), ui="none")
    assert job.status == "done" and job.state.backend == "spark", job.error
    # Both tasks' workers ran and reported; under load one may start after the other has been dealt every
    # block (async's meaning: nobody waits for a late worker), so blocks are counted over both.
    assert sorted(job.reports) == [0, 1] and sum(job.reports[r]["async_pushed"] for r in range(2)) > 0, job.reports
    val_accuracy = job.history["val_accuracy"]
    print("async val_accuracy", val_accuracy, "refused", [job.reports[r]["async_refused"] for r in range(2)])
    assert len(val_accuracy) == 3 and val_accuracy[-1] > 0.85, val_accuracy
    assert float(model.evaluate(Xte, yte, verbose=0)[1]) == pytest.approx(val_accuracy[-1], abs=1e-6)


def test_async_trains_a_notebook_pydataset_on_spark_tasks(spark, data, tmp_path):
    """Issue 38 (benchmark row P13): a PyDataset class defined in the notebook travels by value to the Spark
    tasks' workers, each reads the batches the driver deals it, and the shared model learns."""
    import os

    import keras

    from ..conftest import mlp

    Xtr, Xte, ytr, yte = data
    readers = tmp_path / "readers"

    class Batches(keras.utils.PyDataset):  # defined here, as in a notebook cell: pickled by value
        def __init__(self, x, y, batch, log):
            super().__init__()
            self.x, self.y, self.batch, self.log = x, y, batch, log

        def __len__(self):
            return -(-len(self.x) // self.batch)

        def __getitem__(self, i):
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()}\n")
            return self.x[i * self.batch:(i + 1) * self.batch], self.y[i * self.batch:(i + 1) * self.batch]

    model = mlp(seed=0, optimizer=keras.optimizers.Adam(0.01))
    job = nbdist.train(model, Batches(Xtr, ytr, 32, str(readers)), epochs=2, workers=2, strategy="async",
                       backend="spark", validation_data=(Xte, yte), ui="none")
    assert job.status == "done" and job.state.backend == "spark", job.error
    workers = set(readers.read_text().split()) - {str(os.getpid())}  # the driver reads batch 0 to check it
    # Every worker dealt a block read its batches in its own process (a worker that starts after the other
    # was dealt every block reads none: async waits for nobody).
    took_part = [r for r in range(2) if job.reports[r]["async_pushed"] + job.reports[r]["async_refused"] > 0]
    assert len(workers) == len(took_part) >= 1, (workers, job.reports)
    assert sum(job.reports[r]["async_pushed"] for r in range(2)) > 0
    assert job.history["val_accuracy"][-1] > 0.8, job.history
