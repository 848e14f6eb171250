"""fit's data as nbdist deals it: pure numpy, no processes."""
from __future__ import annotations

import numpy as np
import pytest

from nbdist.data.inputs import FitData, class_weight_to_sample_weight, make_fit_data, split_validation
from nbdist.data.sharding import deal_rows, rank_batch_sizes, run_world
from nbdist.errors import NbdistError
from nbdist.strategies.averaging import batch_sizes


@pytest.mark.parametrize("n, batch, world", [(100, 32, 2), (101, 33, 3), (7, 4, 3), (64, 64, 2), (5, 8, 2)])
def test_every_step_of_the_workers_together_is_one_global_batch(n, batch, world):
    rows = deal_rows(n, batch, world)
    sizes = rank_batch_sizes(batch, world)
    assert sorted(np.concatenate(rows).tolist()) == list(range(n))
    per_worker = [np.split(r, np.cumsum(batch_sizes(len(r), b))[:-1]) for r, b in zip(rows, sizes)]
    steps = max(len(p) for p in per_worker)
    for step in range(steps):
        together = np.concatenate([p[step] for p in per_worker if step < len(p)])
        assert together.tolist() == list(range(step * batch, min(n, (step + 1) * batch)))


def test_a_run_has_as_many_workers_as_its_data_allow():
    """World = min(asked, the global batch's rows, the rows, a PyDataset's batches), the tightest one named."""
    assert run_world(2, {"batch": 64, "rows": 600}) == (2, None)
    assert run_world(2, {"batch": 1, "rows": 4}) == (1, "nbdist: 1 worker instead of 2: the global batch "
                                                        "(batch_size=1) has 1 row, and each step is split into "
                                                        "one part per worker.")
    assert run_world(4, {"batch": 32, "rows": 3}, "evaluation data") == (
        3, "nbdist: 3 workers instead of 4: the evaluation data has 3 rows.")
    world, note = run_world(8, {"batches": 5, "rows": None})
    assert world == 5 and "the PyDataset has 5 batches per epoch" in note
    assert run_world(3, {}) == (3, None)


def test_batch_smaller_than_the_workers_is_one_sentence():
    with pytest.raises(NbdistError, match="batch_size 1 cannot be split over 2 workers"):
        rank_batch_sizes(1, 2)


def test_class_weight_and_validation_split_follow_keras():
    y = np.array([0, 1, 2, 1])
    assert class_weight_to_sample_weight(y, {1: 3.0}).tolist() == [1.0, 3.0, 1.0, 3.0]
    assert class_weight_to_sample_weight(np.eye(3)[y], {2: 0.5}).tolist() == [1.0, 1.0, 0.5, 1.0]
    data = make_fit_data({"a": np.arange(10.0)[:, None], "b": np.arange(10)}, np.arange(10))
    train, val = split_validation(data, 0.25)  # Keras: floor(10 * 0.75) = 7 training rows, the rest validate
    assert len(train) == 7 and val.y.tolist() == [7, 8, 9] and val.x["b"].tolist() == [7, 8, 9]
    layout, arrays = val.flatten()
    again = FitData.unflatten(layout, iter(arrays))
    assert again.x["a"].tolist() == val.x["a"].tolist() and again.sample_weight is None


def test_rows_that_do_not_line_up_are_one_sentence():
    with pytest.raises(NbdistError, match="x has 5 and 4 rows but y has 4 rows"):
        make_fit_data([np.zeros((4, 2)), np.zeros((5, 2))], np.zeros(4))


def test_py_dataset_shares_are_strided_disjoint_and_cover_every_batch():
    """Worker r of N reads order[r::N]: step j of all workers reads N consecutive batches of the epoch;
    every worker computes the same order from the job seed, shuffled anew each epoch."""
    from nbdist.data.sharding import epoch_order, share_count, share_indices

    assert list(share_indices(epoch_order(7, False, 0, 0), 1, 2)) == [1, 3, 5]
    assert [share_count(7, r, 3) for r in range(3)] == [3, 2, 2]
    for epoch in range(3):
        order = epoch_order(11, True, 42, epoch)
        shares = [list(share_indices(order, r, 3)) for r in range(3)]
        assert sorted(sum(shares, [])) == list(range(11))
        assert list(order) == list(epoch_order(11, True, 42, epoch))  # the same on every worker
    assert list(epoch_order(11, True, 42, 0)) != list(epoch_order(11, True, 42, 1))


@pytest.mark.parametrize("batches,world", [(8, 3), (2, 3), (5, 1)])
def test_strided_shares_go_back_in_the_datasets_order(batches, world):
    """Prediction on a PyDataset: each worker's batches in its order (share_indices) put back as one pass."""
    from nbdist.data.sharding import epoch_order, share_indices, strided_batches

    shares = [list(share_indices(epoch_order(batches, False, 0, 0), r, world)) for r in range(world)]
    assert strided_batches(shares) == list(range(batches))


def test_a_scipy_sparse_matrix_is_its_dense_rows_or_one_sentence_when_too_large():
    """TfidfVectorizer's output, as Keras' fit takes it: a Dense layer computes alike on the dense rows."""
    sparse = pytest.importorskip("scipy.sparse")
    from nbdist.data.inputs import make_fit_data
    from nbdist.data.structures import dense_from_sparse

    matrix = sparse.random(30, 12, density=0.2, format="csr", random_state=0, dtype="float64")
    data = make_fit_data(matrix, np.arange(30) % 2)
    assert data.x.dtype == np.float32 and data.x.shape == (30, 12)
    np.testing.assert_allclose(data.x, matrix.toarray(), rtol=1e-6)
    with pytest.raises(NbdistError, match=r"scipy sparse matrix of 30 x 12, .* reduce its columns"):
        dense_from_sparse(matrix, "training data x", budget=100)


def test_a_tf_sparse_tensor_or_jax_bcoo_is_its_dense_rows_or_one_sentence_when_too_large():
    """A tf.SparseTensor or a JAX BCOO array as x (Keras' backends take them; a Dense layer computes alike on the
    dense rows), as fit's x or inside a generator's batch, where they were "Python objects"."""
    import tensorflow as tf

    from nbdist.data.inputs import make_fit_data
    from nbdist.data.structures import dense_from_sparse

    dense = np.where(np.random.default_rng(0).random((30, 12)) < 0.2, 1.5, 0.0)
    tensor = tf.sparse.from_dense(dense)
    data = make_fit_data(tensor, np.arange(30) % 2)
    assert data.x.dtype == np.float32 and data.x.shape == (30, 12)
    np.testing.assert_array_equal(data.x, dense.astype("float32"))
    with pytest.raises(NbdistError, match=r"tf.SparseTensor of 30 x 12, .* reduce its columns"):
        dense_from_sparse(tensor, "training data x", budget=100)
    from jax.experimental import sparse  # JAX's sparse input (BCOO), as Keras' JAX backend takes it

    np.testing.assert_array_equal(make_fit_data(sparse.BCOO.fromdense(dense), np.arange(30) % 2).x,
                                  dense.astype("float32"))


def test_predictions_keep_keras_structure():
    """Issue 46: predict's tuples and namedtuples survive the wire's flat layout."""
    import collections

    from nbdist.data.structures import flatten_outputs, unflatten_outputs

    pair = collections.namedtuple("Pair", "a b")
    globals()["Pair"] = pair  # found by module and name, as a notebook's class is in __main__
    pair.__module__ = __name__
    out = [np.zeros((2, 1)), (np.ones((2, 3)), pair(np.ones((2, 2)), np.zeros((2, 1)))), {"k": np.ones((2,))}]
    layout, arrays = flatten_outputs(out)
    back = unflatten_outputs(layout, iter(arrays))
    assert type(back) is list and type(back[1]) is tuple and type(back[1][1]) is pair and type(back[2]) is dict
    np.testing.assert_array_equal(back[1][1].a, np.ones((2, 2)))


def test_ragged_rows_are_dealt_travel_as_arrays_and_come_back_as_tf_gather_gives_them():
    """Issue 46: a tf.RaggedTensor (ragged rank 1 and 2, rows of values with a shape of their own) becomes
    numpy components at the door, each worker's dealt rows of it cross the wire as plain arrays and are the
    tf.RaggedTensor ``tf.gather`` gives; validation_split's last rows and a prediction's shards joined too."""
    import tensorflow as tf

    from nbdist.data.ragged import RaggedRows
    from nbdist.data.structures import concat_flat, flatten, flatten_outputs, unflatten, unflatten_outputs
    from nbdist.model.tensors import keras_data

    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 5, size=23)
    tokens = tf.RaggedTensor.from_row_lengths(rng.integers(0, 50, size=int(lengths.sum())).astype("int32"), lengths)
    nested = tf.RaggedTensor.from_nested_row_lengths(rng.normal(size=(10, 3)).astype("float32"),
                                                     [[2, 0, 3, 1], [2, 1, 0, 4, 1, 2]])
    data = make_fit_data({"tokens": tokens, "dense": np.arange(23.0)[:, None]}, np.arange(23))
    assert isinstance(data.x["tokens"], RaggedRows) and len(data) == 23 and data.x["tokens"].shape == (23, None)

    def same(got, want):
        assert isinstance(got, tf.RaggedTensor) and got.dtype == want.dtype
        assert got.row_splits.dtype == want.row_splits.dtype and got.to_list() == want.to_list()

    for rows in deal_rows(23, 8, 3):
        layout, arrays = flatten(data.take(rows).x)
        assert all(type(a) is np.ndarray for a in arrays)  # plain numpy on the wire: nothing of TensorFlow
        same(keras_data(unflatten(layout, iter(list(arrays))))["tokens"], tf.gather(tokens, rows))
    _, val = split_validation(data, 0.25)
    same(keras_data(val.x["tokens"]), tokens[17:])  # Keras: the last 25%, floor(23 * 0.75) on
    for value in (tokens, nested):
        rows = make_fit_data(value).x
        same(keras_data(rows[np.array([3, 0, 3, 2])]), tf.gather(value, [3, 0, 3, 2]))
        shards = [flatten_outputs(value[a:b]) for a, b in ((0, 2), (2, 2), (2, len(rows)))]
        layout = shards[0][0]
        same(keras_data(unflatten_outputs(layout, iter(concat_flat(layout, [s[1] for s in shards])))), value)


def test_a_generators_ragged_batches_are_joined_as_ragged_rows():
    """model.fit(generator) whose batches hold a tf.RaggedTensor (TensorFlow backend): the batches read for the
    fit join into one ragged input, row for row, which the arrays path splits as it splits any (it was refused)."""
    import tensorflow as tf

    from nbdist.data.pipelines import fit_from_pipelines
    from nbdist.fit_arguments import FitCall

    rows = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]

    def batches():
        for start in (0, 2, 4):
            yield tf.ragged.constant(rows[start:start + 2]), np.arange(start, min(start + 2, 5))

    fit = fit_from_pipelines(FitCall(x=batches()))
    assert fit.batch_size == 2 and not fit.shuffle and list(fit.y) == [0, 1, 2, 3, 4]
    assert tf.RaggedTensor.from_nested_row_splits(fit.x.values, fit.x.splits).to_list() == rows
    data = make_fit_data(fit.x, tf.ragged.constant(rows))  # ragged labels too, as Keras' Embedding test has
    assert data.x is fit.x and data.y.splits[0].tolist() == [0, 2, 3, 6, 7, 9]


def test_bfloat16_and_float8_arrays_train_as_their_float32_values():
    """ml_dtypes' floats (numpy sees raw bytes, and the wire carries numpy's own dtypes): widened to float32, which
    holds each value exactly; Keras casts a floating input to the layer's compute dtype either way (Keras'
    quantized layer tests feed bfloat16; they were refused as "not numbers")."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    from nbdist.data.inputs import make_fit_data

    values = np.array([[0.5, -2.0], [3.0, 0.125], [1.5, 4.0]], "float32")
    for dtype in (ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn):
        data = make_fit_data(values.astype(dtype), values[:, :1].astype(dtype))
        assert data.x.dtype == data.y.dtype == np.float32
        np.testing.assert_array_equal(data.x, values)
