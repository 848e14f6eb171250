"""Reading a tf.data pipeline once (nbdist/data/pipelines.py): what it yields, and what it refuses, in one sentence."""
from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from nbdist.data.pipelines import fit_from_pipelines, read_pipeline  # noqa: E402
from nbdist.errors import NbdistError  # noqa: E402
from nbdist.fit_arguments import FitCall  # noqa: E402

X = np.arange(40, dtype="float32").reshape(20, 2)
Y = np.arange(20, dtype="int64")


def test_rows_batch_size_and_shuffle_come_from_the_pipeline():
    rows = read_pipeline(tf.data.Dataset.from_tensor_slices((X, Y)).batch(8).prefetch(1), "x")
    np.testing.assert_array_equal(rows.x, X)
    np.testing.assert_array_equal(rows.y, Y)
    assert rows.sample_weight is None and rows.batch_size == 8 and not rows.shuffled
    shuffled = read_pipeline(tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(20, seed=1).batch(8), "x")
    assert shuffled.shuffled and sorted(shuffled.y.tolist()) == Y.tolist()
    # Each row keeps its label through the shuffle.
    np.testing.assert_array_equal(shuffled.x[:, 0], shuffled.y * 2)


def test_several_inputs_weights_and_a_validation_pipeline():
    inputs = {"a": X, "b": X[:, :1]}
    weights = np.linspace(0.5, 1.5, 20).astype("float32")
    fit = FitCall(x=tf.data.Dataset.from_tensor_slices((inputs, Y, weights)).batch(6),
                  validation_data=tf.data.Dataset.from_tensor_slices(((X, X), Y)).batch(5))
    out = fit_from_pipelines(fit)
    assert set(out.x) == {"a", "b"} and out.x["b"].shape == (20, 1)
    np.testing.assert_allclose(out.sample_weight, weights)
    assert out.batch_size == 6 and out.shuffle is False
    xv, yv = out.validation_data
    assert isinstance(xv, list) and len(xv) == 2 and yv.shape == (20,)
    plain = FitCall(x=X)
    assert fit_from_pipelines(plain) is plain


@pytest.mark.parametrize("make, words", [
    (lambda: tf.data.Dataset.from_tensor_slices((X, Y)).batch(4).repeat(), "repeats forever"),
    (lambda: tf.data.Dataset.from_tensor_slices((X, Y)).map(lambda x, y: (x * tf.random.normal((2,)), y)).batch(4),
     "draws random numbers (RandomStandardNormal"),
    (lambda: tf.data.Dataset.from_tensor_slices((X, Y)), "without .batch(...)"),
    (lambda: tf.data.Dataset.range(20).map(lambda i: (tf.zeros((i + 1,)), i)).padded_batch(4),
     "differ in shape beyond their rows"),
    (lambda: tf.data.Dataset.from_tensor_slices((X, Y, Y, Y)).batch(4), "elements have 4 parts"),
    (lambda: tf.data.Dataset.from_tensor_slices((X, Y)).filter(lambda x, y: y < 0).batch(4), "yields no batches"),
])
def test_what_reading_once_cannot_keep_is_one_sentence(make, words):
    with pytest.raises(NbdistError) as info:
        read_pipeline(make(), "the training data x")
    assert words in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_pipeline_larger_than_the_budget_is_refused_before_it_is_all_read():
    seen = []
    big = tf.data.Dataset.from_tensor_slices((X, Y)).batch(2).map(
        lambda x, y: (tf.numpy_function(lambda v: seen.append(1) or v, [x], tf.float32), y))
    with pytest.raises(NbdistError, match="pipeline of more than .* pass a Spark DataFrame"):
        read_pipeline(big, "the training data x", budget=100)
    assert len(seen) < 10


def test_a_torch_loader_over_tensors_is_its_tensors_its_batch_and_its_shuffle():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from nbdist.data.pipelines import read_any

    weights = torch.linspace(0.5, 1.5, 20)
    rows = read_any(DataLoader(TensorDataset(torch.from_numpy(X), torch.from_numpy(Y), weights), batch_size=6,
                               shuffle=True), "the training data x")
    np.testing.assert_array_equal(rows.x, X)
    np.testing.assert_array_equal(rows.y, Y)
    np.testing.assert_allclose(rows.sample_weight, weights.numpy())
    assert rows.batch_size == 6 and rows.shuffled
    assert not read_any(DataLoader(TensorDataset(torch.from_numpy(X)), batch_size=4), "x").shuffled


def test_what_a_torch_loader_cannot_keep_when_read_once_is_one_sentence():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from nbdist.data.pipelines import read_any

    tensors = TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))
    cases = [
        (DataLoader(X, batch_size=4), "over a ndarray, whose __getitem__ may change a row"),
        (DataLoader(tensors, batch_size=4, sampler=RandomSampler(tensors, replacement=True)), "its own sampler"),
        (DataLoader(tensors, batch_size=4, collate_fn=lambda b: b), "its own collate_fn"),
        (DataLoader(tensors, batch_size=6, drop_last=True), "drop_last=True, which drops 2 different rows"),
    ]
    for loader, words in cases:
        with pytest.raises(NbdistError) as info:
            read_any(loader, "the training data x")
        assert words in str(info.value) and "\n" not in str(info.value), str(info.value)
    with pytest.raises(NbdistError, match="DataLoader of more than"):
        read_any(DataLoader(tensors, batch_size=4), "x", budget=100)


def test_a_loader_over_a_map_style_dataset_is_dealt_by_index_in_its_samplers_order():
    """Issue 46: item i of the split loader is worker i % world's part of the loader's batch i // world,
    collated by its collate_fn; shuffle=True: one permutation per epoch, the same in every copy, every row
    once (drop_last drops the short batch); an IterableDataset, or a batch smaller than the workers, is
    refused in one sentence."""
    pytest.importorskip("torch")
    import cloudpickle
    from torch.utils.data import DataLoader, IterableDataset

    from nbdist.data.pipelines import split_loaders

    rows = list(range(10))
    collate = lambda batch: (np.array(batch, "float32")[:, None], np.array(batch) % 2)
    fit = split_loaders(FitCall(x=DataLoader(rows, batch_size=4, collate_fn=collate), shuffle=True), 2, 7)
    shares = fit.x
    assert (fit.batch_size, fit.shuffle, len(shares)) == (None, False, 6)
    assert [shares[i][0].ravel().tolist() for i in range(6)] == [[0, 1], [2, 3], [4, 5], [6, 7], [8], [9]]
    assert shares[1][1].tolist() == [0, 1]

    shuffled = split_loaders(FitCall(x=DataLoader(rows, batch_size=3, shuffle=True, drop_last=True)), 2, 7).x
    copy = cloudpickle.loads(cloudpickle.dumps(shuffled))
    epochs = []
    for ds in (shuffled, copy):
        ds.on_epoch_begin()
        first = [ds[i].tolist() for i in range(len(ds))]
        ds.on_epoch_begin()
        epochs.append((first, [ds[i].tolist() for i in range(len(ds))]))
    assert epochs[0] == epochs[1] and epochs[0][0] != epochs[0][1]
    for epoch in epochs[0]:
        dealt = sum(epoch, [])
        assert len(ds) == 6 and len(dealt) == 9 == len(set(dealt))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(rows)

    with pytest.raises(NbdistError, match="over an IterableDataset .Stream. cannot be split"):
        split_loaders(FitCall(x=DataLoader(Stream(), batch_size=4)), 2, 7)
    with pytest.raises(NbdistError, match="batch_size 1 cannot be split over 2 workers"):
        split_loaders(FitCall(x=DataLoader(rows, batch_size=1)), 2, 7)
