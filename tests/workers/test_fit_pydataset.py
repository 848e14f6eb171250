"""A keras.utils.PyDataset defined in the notebook, passed to the cell's own model.fit (issue 17).

Each worker reads its own strided share of the batch indices; one step of all workers consumes
`workers` of its batches. Real TF, real worker processes, digits.
"""
from __future__ import annotations

import os
from collections import defaultdict

import keras
import numpy as np
import pytest

import nbdist

from ..conftest import relative_error

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

# Defined in a cell: the class lives in the notebook (__main__) and travels by value.
BATCHES_CELL = """
import os
import keras, numpy as np
class Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch, w=None, dict_inputs=False, log=None, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.w, self.dict_inputs, self.log = x, y, w, dict_inputs, log
        # batch: rows per batch, or the list of the batches' edges (batches of different sizes)
        self.edges = list(range(0, len(x), batch)) + [len(x)] if isinstance(batch, int) else list(batch)
        self.epoch = 0
    def __len__(self):
        return len(self.edges) - 1
    def __getitem__(self, i):
        if self.log:  # which process read which batch in which epoch
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {self.epoch} {i}\\n")
        s = slice(self.edges[i], self.edges[i + 1])
        x = {"pixels": self.x[s]} if self.dict_inputs else self.x[s]
        return (x, self.y[s]) if self.w is None else (x, self.y[s], self.w[s])
    def on_epoch_end(self):
        self.epoch += 1
"""

EXACT_CELL = """
keras.utils.set_random_seed(2)
pixels = keras.Input((64,), name="pixels")
model = keras.Model({"pixels": pixels}, keras.layers.Dense(10, activation="softmax")(
    keras.layers.Dense(32, activation="relu")(pixels)))
model.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
start = [w.copy() for w in model.get_weights()]
hist = model.fit(Batches(Xp, yp, EDGES, w=wp, dict_inputs=True), epochs=2, shuffle=False, verbose=0)
"""


def test_uneven_py_dataset_under_allreduce_equals_the_local_fit_of_joined_batches(ip, digits):
    """15 batches (13 of 40 rows, then 30 and 20), dict inputs and sample weights, allreduce, SGD:
    worker 0 reads batches 0, 2, ..., 14, worker 1 batches 1, 3, ..., 13 and pads the last step. The
    weights equal a local fit of the PyDataset whose batch j joins batches 2j and 2j+1 to 1e-5: every
    step weighted each worker's gradient by the rows it really read (40 against 30 in step 6), and
    the shorter share took part in the last step without rows."""
    x, y = digits[0][:570], digits[1][:570]
    w = np.random.default_rng(0).uniform(0.2, 3.0, len(x)).astype("float32")
    edges = [*range(0, 521, 40), 550, 570]
    ip.run_cell(BATCHES_CELL)
    ip.user_ns.update(Xp=x, yp=y, wp=w, EDGES=edges)
    ip.run_cell_magic("dist_train", "--workers 2 --strategy allreduce --ui none", EXACT_CELL)
    ns = ip.user_ns
    remote = ns["model"]
    local = keras.models.clone_model(remote)
    local.compile(keras.optimizers.SGD(0.1), "sparse_categorical_crossentropy", metrics=["accuracy"])
    local.set_weights(ns["start"])
    joined = ns["Batches"](x, y, [*edges[::2], edges[-1]], w=w, dict_inputs=True)
    expected = local.fit(joined, epochs=2, shuffle=False, verbose=0)
    err = relative_error(remote.get_weights(), local.get_weights())
    assert err < 1e-5, err
    np.testing.assert_allclose(ns["hist"].history["loss"], expected.history["loss"], rtol=1e-5)
    padded = {rank: r["padded_steps"] for rank, r in ns["history_job"].reports.items()}
    assert padded == {0: 0, 1: 2}, padded  # one padded step per epoch on the shorter share


ACCURACY_CELL = """
keras.utils.set_random_seed(5)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, activation="relu"),
                          keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.004), "sparse_categorical_crossentropy", metrics=["accuracy"])
hist = model.fit(Batches(Xd, yd, 32, log=TRAIN_LOG), validation_data=Batches(Xt, yt, 64, log=VAL_LOG),
                 epochs=EPOCHS, verbose=0)
"""


def _shares(path: str, epochs: int) -> dict[int, dict[int, list[int]]]:
    """epoch -> worker pid -> the batch indices it read (the driver's own check of batch 0 left out)."""
    out: dict[int, dict[int, list[int]]] = defaultdict(lambda: defaultdict(list))
    with open(path) as f:
        for line in f:
            pid, epoch, index = map(int, line.split())
            if pid != os.getpid() and epoch < epochs:  # the read-ahead may have begun the next epoch
                out[epoch][pid].append(index)
    return out


@pytest.mark.parametrize("strategy", [pytest.param("averaging", marks=pytest.mark.full(
    "each worker reading its share of a PyDataset: the allreduce case")), "allreduce"])
def test_py_dataset_trains_like_local_and_each_worker_reads_its_share(ip, digits_split, tmp_path, strategy):
    """A shuffled PyDataset over digits (43 batches of 32) with a PyDataset as validation_data, on 2
    workers: test accuracy within 1 point of the same cell run locally; in every epoch each worker
    read a disjoint share of the batch indices and together they read each index exactly once, in
    training and in validation; the shares change from epoch to epoch (the batch order is shuffled)."""
    x_train, x_test, y_train, y_test = digits_split
    epochs = 10
    ip.run_cell(BATCHES_CELL)
    train_log, val_log = str(tmp_path / "train.log"), str(tmp_path / "val.log")
    ip.user_ns.update(Xd=x_train, yd=y_train, Xt=x_test, yt=y_test, EPOCHS=epochs, TRAIN_LOG=train_log,
                      VAL_LOG=val_log)
    # --seed: the shuffled order and the workers' seeds fixed, so the 1-point claim is checked on one known run.
    ip.run_cell_magic("dist_train", f"--workers 2 --strategy {strategy} --ui none --seed 5", ACCURACY_CELL)
    ns = ip.user_ns
    remote = ns["model"].evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    history = ns["hist"].history
    assert len(history["val_accuracy"]) == epochs
    assert abs(history["val_accuracy"][-1] - remote) < 1e-6  # merged validation over both shares

    batches, val_batches = -(-len(x_train) // 32), -(-len(x_test) // 64)
    for log, n in ((train_log, batches), (val_log, val_batches)):
        shares = _shares(log, epochs)
        assert sorted(shares) == list(range(epochs)), log
        for epoch, by_worker in shares.items():
            assert len(by_worker) == 2, (log, epoch)
            a, b = (set(v) for v in by_worker.values())
            assert not a & b, (log, epoch)
            assert sorted(sum(by_worker.values(), [])) == list(range(n)), (log, epoch)
    train = _shares(train_log, epochs)
    assert len({frozenset(next(iter(train[e].values()))) for e in range(epochs)}) > 1  # shuffled per epoch

    ns.update(TRAIN_LOG=None, VAL_LOG=None)
    ip.run_cell(ACCURACY_CELL)  # the same cell, locally
    local = ns["model"].evaluate(x_test, y_test, verbose=0, return_dict=True)["accuracy"]
    assert abs(remote - local) <= 0.01 + 1e-9, (strategy, remote, local)


def test_py_dataset_of_fewer_batches_than_workers_and_refusals(ip, digits):
    """Fewer batches than workers: as many workers as batches, said in one line; a batch_size or y beside a
    PyDataset: one sentence, no worker started."""
    x, y = digits[0][:40], digits[1][:40]
    ip.run_cell(BATCHES_CELL)
    batches = ip.user_ns["Batches"]
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    job = nbdist.train(model, batches(x, y, 64), workers=2)
    assert job.status == "done" and job.world_size == 1
    assert job.state.world_note == ("nbdist: 1 worker instead of 2: the PyDataset has 1 batch per epoch, and each "
                                    "worker reads whole batches.")
    ip.user_ns.update(Xs=x, ys=y)
    ip.user_ns["small"] = model
    from IPython.core.error import UsageError

    with pytest.raises(UsageError, match="a PyDataset makes its own batches: drop batch_size"):
        ip.run_cell_magic("dist_train", "--workers 2 --ui none", "small.fit(Batches(Xs, ys, 8), batch_size=8)")
    with pytest.raises(UsageError, match="was given a PyDataset and y; drop y"):
        ip.run_cell_magic("dist_train", "--workers 2 --ui none", "small.fit(Batches(Xs, ys, 8), ys)")


SHUFFLED_CELL = """
import os
import keras, numpy as np
class Shuffled(keras.utils.PyDataset):
    '''The classic Keras Sequence: its rows reshuffled by numpy's global generator at every epoch's end.'''
    def __init__(self, x, y, batch, log):
        super().__init__()
        self.x, self.y, self.batch, self.log = x, y, batch, log
        self.rows, self.epoch = np.arange(len(x)), 0
    def __len__(self):
        return -(-len(self.x) // self.batch)
    def __getitem__(self, i):
        ids = self.rows[i * self.batch:(i + 1) * self.batch]
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {self.epoch} {' '.join(map(str, ids))}\\n")
        return self.x[ids], self.y[ids]
    def on_epoch_end(self):
        self.epoch += 1
        np.random.shuffle(self.rows)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
model.compile("sgd", "sparse_categorical_crossentropy")
model.fit(Shuffled(Xs, ys, 32, ROW_LOG), epochs=3, verbose=0)
"""


def test_a_py_dataset_that_reshuffles_its_rows_at_each_epoch_end_gives_each_row_once_an_epoch(ip, digits, tmp_path):
    """Each worker calls its own copy's on_epoch_end, which shuffles with numpy's global generator (a different
    stream on every worker): nbdist seeds it alike for the call, so in every epoch the workers' batches together
    hold every row exactly once, as the notebook's one copy would give them."""
    log = tmp_path / "rows.log"
    ip.user_ns.update(Xs=digits[0][:320], ys=digits[1][:320], ROW_LOG=str(log))
    ip.run_cell_magic("dist_train", "--workers 2 --ui none", SHUFFLED_CELL)
    read: dict[int, list[int]] = defaultdict(list)
    workers = set()
    for line in log.read_text().splitlines():
        pid, epoch, *ids = map(int, line.split())
        if pid != os.getpid() and epoch < 3:  # the notebook's look at batch 0; the read-ahead of a 4th epoch
            read[epoch] += ids
            workers.add(pid)
    assert len(workers) == 2
    assert sorted(read) == [0, 1, 2]
    for epoch, ids in read.items():
        assert sorted(ids) == list(range(320)), (epoch, len(ids), len(set(ids)))


STEPS_CELL = """
keras.utils.set_random_seed(3)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
hist = model.fit(Batches(Xd, yd, 32, log=TRAIN_LOG), steps_per_epoch=STEPS, epochs=4, verbose=0,
                 validation_data=Batches(Xt, yt, 40, log=VAL_LOG), validation_steps=2, validation_freq=2)
"""


def test_steps_per_epoch_validation_steps_and_freq_with_py_datasets(ip, digits, tmp_path):
    """steps_per_epoch=6 over a shuffled PyDataset of 18 batches, 4 epochs: each epoch the workers read 6 batches
    between them, the first three epochs one whole pass and the fourth the start of the next, as Keras' one
    iterator reads them; validation_steps=2 reads the validation PyDataset's first 2 batches, at every 2nd epoch
    (validation_freq). A steps_per_epoch that would make Keras' epochs unalike is one sentence."""
    from IPython.core.error import UsageError

    ip.run_cell(BATCHES_CELL)
    train_log, val_log = tmp_path / "train.log", tmp_path / "val.log"
    ip.user_ns.update(Xd=digits[0][:576], yd=digits[1][:576], Xt=digits[0][600:800], yt=digits[1][600:800],
                      TRAIN_LOG=str(train_log), VAL_LOG=str(val_log), STEPS=6)
    ip.run_cell_magic("dist_train", "--workers 2 --ui none --seed 4", STEPS_CELL)
    history = ip.user_ns["hist"].history
    assert len(history["loss"]) == 4 and len(history["val_loss"]) == 2
    train = _shares(str(train_log), 4)
    assert [sorted(len(v) for v in train[e].values()) for e in range(4)] == [[3, 3]] * 4
    epochs = [sorted(sum(train[e].values(), [])) for e in range(4)]
    assert all(len(set(e)) == 6 for e in epochs)
    assert sorted(sum(epochs[:3], [])) == list(range(18))  # one pass over three epochs
    assert len({tuple(e) for e in epochs}) == 4
    val = _shares(str(val_log), 10)  # the validation PyDataset counts its own passes
    assert [sorted(sum(val[p].values(), [])) for p in sorted(val)] == [[0, 1], [0, 1]]

    ip.user_ns.update(STEPS=5)  # 5, 5, 5, 3: Keras cuts the 4th epoch short
    with pytest.raises(UsageError, match=r"steps_per_epoch=5 does not divide the PyDataset's 18 batches.*5, 5, 5, 3"):
        ip.run_cell_magic("dist_train", "--workers 2 --ui none", STEPS_CELL)


IMAGE_CELL = """
from tensorflow.keras.preprocessing.image import ImageDataGenerator
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, activation="relu"),
                          keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(0.01), "sparse_categorical_crossentropy", metrics=["accuracy"])
train_gen = ImageDataGenerator(rescale=1.0, width_shift_range=0.1, validation_split=0.25)
hist = model.fit(train_gen.flow(Xi, yi, batch_size=32, subset="training"), steps_per_epoch=27 // STEPS_DIV,
                 epochs=6, verbose=0, validation_data=train_gen.flow(Xi, yi, batch_size=32, subset="validation"))
"""


def test_keras_image_data_generator_flows_train_as_locally(ip, digits):
    """tf.keras' ImageDataGenerator: an augmenting flow over images (its iterator holds a lock and a generator),
    its validation subset as validation_data, steps_per_epoch as such notebooks write it: trains on 2 workers to
    the accuracy the same cell reaches locally, within 5 points."""
    x, y = digits[0][:1152].reshape(-1, 8, 8, 1), digits[1][:1152]
    ip.user_ns.update(Xi=x, yi=y, STEPS_DIV=1)  # 864 training images: 27 batches of 32
    ip.run_cell_magic("dist_train", "--workers 2 --ui none --seed 1", IMAGE_CELL)
    remote = ip.user_ns["hist"].history
    assert len(remote["val_accuracy"]) == 6
    ip.run_cell(IMAGE_CELL)
    local = ip.user_ns["hist"].history
    assert remote["val_accuracy"][-1] > 0.8, remote
    assert abs(remote["val_accuracy"][-1] - local["val_accuracy"][-1]) < 0.05, (remote, local)


FAILING_READ_CELL = """
import keras
class Files(keras.utils.PyDataset):
    '''Batch 13 cannot be read (a corrupt image file): worker 1 reads it, while worker 0 waits for the step.'''
    def __len__(self):
        return 20
    def __getitem__(self, i):
        if i == 13:
            raise ValueError(f"cannot decode image file {i}.png")
        return Xf[i * 32:(i + 1) * 32], yf[i * 32:(i + 1) * 32]
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10, activation="softmax")])
model.compile("sgd", "sparse_categorical_crossentropy")
model.fit(Files(), epochs=2, shuffle=False, verbose=0)
"""


@pytest.mark.parametrize("workers", [2, 3])
def test_a_batch_that_cannot_be_read_raises_its_own_error_not_the_peers_broken_connection(ip, digits, workers):
    """The worker that reads the bad batch raises the dataset's ValueError; its peers, waiting in the step's
    collective, fail a moment before with Gloo's "Connection closed by peer". The cell raises the cause, as
    Keras' fit would raise it, from worker 1 (13 % workers)."""
    from nbdist.errors import raised_on_worker

    ip.user_ns.update(Xf=digits[0][:640], yf=digits[1][:640])
    result = ip.run_cell(f"%%dist_train --workers {workers} --ui none\n" + FAILING_READ_CELL)
    error = result.error_in_exec
    assert type(error) is ValueError and raised_on_worker(error), repr(error)
    assert str(error) == "cannot decode image file 13.png" and error.rank == 1
