"""The Connect-ready task's pure parts: Arrow batches to shard files, slots and addresses from configuration."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from nbdist.spark.backend import connect_slots, session_hosts
from nbdist.spark.task import VALIDATION_COLUMN, Layout, unreachable, write_batches, write_split_batches
from nbdist.wire.shardfile import VALIDATION_DIR, ShardReader, load_task_data

VECTOR = pa.struct([("type", pa.int8()), ("size", pa.int32()), ("indices", pa.list_(pa.int32())),
                    ("values", pa.list_(pa.float64()))])


def test_arrow_batches_become_the_shard(tmp_path):
    batches = [
        pa.RecordBatch.from_pydict({
            "px": pa.array([[0.0, 1.0], [2.0, 3.0]], pa.list_(pa.float64())),
            "v": pa.array([{"type": 1, "size": None, "indices": None, "values": [4.0]},
                           {"type": 0, "size": 1, "indices": [0], "values": [5.0]}], VECTOR),
            "n": pa.array([6, 7], pa.int64()), "y": pa.array([1, 0], pa.int64())}),
        pa.RecordBatch.from_pydict({  # an empty batch changes nothing
            "px": pa.array([], pa.list_(pa.float64())), "v": pa.array([], VECTOR), "n": pa.array([], pa.int64()),
            "y": pa.array([], pa.int64())}),
    ]
    rows = write_batches(iter(batches), Layout(("px", "v", "n"), "y"), str(tmp_path))
    x, y = load_task_data(str(tmp_path))
    assert rows == 2
    np.testing.assert_array_equal(x, np.array([[0, 1, 4, 6], [2, 3, 5, 7]], np.float32))
    assert y.dtype == np.int64 and y.tolist() == [1, 0]


def test_marked_validation_rows_go_to_their_own_shard(tmp_path):
    def batch(xs, marks):
        return pa.RecordBatch.from_pydict({"px": pa.array(xs, pa.float64()), "y": pa.array([int(v) for v in xs]),
                                           VALIDATION_COLUMN: pa.array(marks)})

    batches = [batch([0.0, 1.0, 2.0], [False, True, False]), batch([3.0, 4.0], [True, True]),
               batch([5.0], [False])]
    rows = write_split_batches(iter(batches), Layout(("px",), "y"), str(tmp_path), validation=True)
    assert rows == (3, 3)
    x, y = load_task_data(str(tmp_path))
    assert x.ravel().tolist() == [0, 2, 5] and y.tolist() == [0, 2, 5]
    val = ShardReader(str(tmp_path / VALIDATION_DIR))
    assert val.block_rows == [1, 2]  # one block per batch that holds validation rows
    assert val.read_all()[0].ravel().tolist() == [1, 3, 4]


def test_ragged_or_null_columns_are_one_sentence(tmp_path):
    ragged = pa.RecordBatch.from_pydict({"px": pa.array([[0.0], [1.0, 2.0]]), "y": pa.array([0, 1])})
    with pytest.raises(ValueError, match="has 1 values in some rows but 2 in others"):
        write_batches(iter([ragged]), Layout(("px",), "y"), str(tmp_path))
    nulls = pa.RecordBatch.from_pydict({"px": pa.array([1.0, None]), "y": pa.array([0, 1])})
    with pytest.raises(ValueError, match="holds nulls"):
        write_batches(iter([nulls]), Layout(("px",), "y"), str(tmp_path))


def test_connect_slots_from_the_servers_configuration():
    def conf(values):
        return lambda key: values.get(key)

    assert connect_slots(conf({"spark.master": "local[2]"})) == 2
    assert connect_slots(conf({"spark.master": "local[4]", "spark.task.cpus": "2"})) == 2
    assert connect_slots(conf({"spark.default.parallelism": "6", "spark.master": "local[2]"})) == 6
    assert connect_slots(conf({"spark.master": "spark://h:7077", "spark.executor.instances": "3",
                               "spark.executor.cores": "4"})) == 12
    assert connect_slots(conf({"spark.master": "yarn"})) == 2  # nothing to go by


def test_a_named_address_is_advertised_and_every_interface_bound():
    assert session_hosts(object(), "10.1.2.3") == ("0.0.0.0", "10.1.2.3")
    sentence = unreachable(("10.1.2.3", 4242), TimeoutError("timed out"))
    assert "10.1.2.3:4242" in sentence and "advertise_host" in sentence and "\n" not in sentence


def test_vector_labels_cross_the_shard_as_rows_of_values(tmp_path):
    """Issue 46 item 7: one-hot labels (Elephas' to_simple_rdd pairs, an array label column) were refused by
    Arrow ("only handle 1-dimensional arrays"); they come back as the (rows, k) array they were."""
    onehot = [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    batch = pa.RecordBatch.from_pydict({"px": pa.array([1.0, 2.0]), "y": pa.array(onehot, pa.list_(pa.float64()))})
    assert write_batches(iter([batch]), Layout(("px",), "y"), str(tmp_path)) == 2
    x, y = load_task_data(str(tmp_path))
    assert y.shape == (2, 3) and y.tolist() == onehot
