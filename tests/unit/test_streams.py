"""The streamed share (worker/streams.py) and the shard file it reads (wire/shardfile.py): no Spark, no TF."""
from __future__ import annotations

import logging

import numpy as np
import pytest

from nbdist.wire.shardfile import ShardReader, ShardWriter
from nbdist.worker.streams import ShardStream, epoch_rng, window_batches


def _shard(tmp_path, sizes, width=3):
    w = ShardWriter(str(tmp_path), labels=True)
    start = 0
    for n in sizes:
        rows = np.arange(start, start + n)
        w.append(np.repeat(rows[:, None], width, axis=1).astype(np.float32), rows.astype(np.int64))
        start += n
    w.close()
    return ShardReader(str(tmp_path)), start


def test_shard_file_reads_each_block_alone(tmp_path):
    reader, n = _shard(tmp_path, [5, 0, 7, 3])
    assert reader.blocks == 3 and reader.block_rows == [5, 7, 3] and reader.rows == n == 15
    x, y = reader.block(1)
    assert x.shape == (7, 3) and x.dtype == np.float32 and y.tolist() == list(range(5, 12))
    x, y = reader.read_all()
    assert y.tolist() == list(range(15)) and (x[:, 2] == y).all()



def test_ragged_rows_are_one_sentence(tmp_path):
    w = ShardWriter(str(tmp_path), labels=False)
    w.append(np.zeros((1, 2)), None)
    with pytest.raises(ValueError, match="same number of values"):
        w.append(np.zeros((1, 4)), None)
    w.close()


def test_an_empty_partition_is_zero_rows(tmp_path):
    reader = ShardReader(str(tmp_path))
    assert reader.rows == 0 and reader.blocks == 0


def _epoch(reader, batch, shuffle, buffer_bytes, epoch=0, seed=7):
    stream = ShardStream(reader, batch, shuffle, seed, 0, buffer_bytes)
    return [b[1] for b in stream.epoch(epoch)]


def test_without_shuffle_batches_are_keras_batches_in_order(tmp_path):
    reader, n = _shard(tmp_path, [5, 7, 3, 9])
    for buffer_bytes in (1, 40, 10**9):  # window of one batch, of a few blocks, of the whole share
        batches = _epoch(reader, 4, False, buffer_bytes)
        assert [len(b) for b in batches] == [4] * 6  # 24 rows: full batches, then no short one
        assert np.concatenate(batches).tolist() == list(range(n))
    batches = _epoch(reader, 5, False, 40)
    assert [len(b) for b in batches] == [5, 5, 5, 5, 4]  # the short batch last


def test_shuffle_permutes_every_row_once_per_epoch_and_differs_between_epochs(tmp_path):
    reader, n = _shard(tmp_path, [5, 7, 3, 9, 11])
    first, second = (np.concatenate(_epoch(reader, 4, True, 48, epoch=e)) for e in (0, 1))
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(n))
    assert first.tolist() != list(range(n)) and first.tolist() != second.tolist()
    assert np.concatenate(_epoch(reader, 4, True, 48, epoch=0)).tolist() == first.tolist()  # seeded
    assert [len(b) for b in _epoch(reader, 4, True, 48)] == [4] * 8 + [3]


def test_a_small_window_keeps_rows_near_their_block_order():
    blocks = iter([(np.arange(i * 10, i * 10 + 10),) for i in range(10)])
    batches = list(window_batches(blocks, 5, 20, True, epoch_rng(0, 0)))
    # The first two batches come from the first window: the first 20 rows (2 blocks).
    assert np.concatenate([b[0] for b in batches[:2]]).max() < 20
    assert np.diff(batches[0][0]).tolist() != [1] * 4  # the window's rows are permuted, not only its blocks
    assert sorted(np.concatenate([b[0] for b in batches]).tolist()) == list(range(100))


def test_a_whole_npy_memory_map_is_read_by_rows_from_its_file(tmp_path, monkeypatch, caplog):
    from nbdist.data.files import npy_file
    from nbdist.data.inputs import make_fit_data
    from nbdist.wire.shardfile import NpyRows

    x = np.arange(40, dtype=np.float64).reshape(10, 2, 2)
    np.save(tmp_path / "x.npy", x)
    mapped = np.load(tmp_path / "x.npy", mmap_mode="r")
    assert npy_file(mapped[2:]) is None and npy_file(np.asarray(x)) is None  # only the file's own rows
    data = make_fit_data(mapped, np.arange(10))
    assert data.x_file is not None and data.x_file.shape == (10, 2, 2)
    monkeypatch.setattr(NpyRows, "BLOCK_BYTES", 40)  # 32-byte rows: one a block
    rows = NpyRows(data.x_file.rows(3, 10), np.arange(10)[3:10])
    got = [rows.block(i) for i in range(rows.blocks)]
    rows.close()
    assert rows.rows == rows.blocks == 7 and got[0][0].dtype == np.float32
    np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), x[3:10])
    assert np.concatenate([g[1] for g in got]).tolist() == list(range(3, 10))
    x[9, 1, 1] = np.nan  # found by reading the file, not the map
    np.save(tmp_path / "bad.npy", x)
    with caplog.at_level(logging.WARNING, logger="nbdist"):  # Keras trains on NaN: one line says so
        make_fit_data(np.load(tmp_path / "bad.npy", mmap_mode="r"), np.arange(10))
    assert "(the features 1)" in caplog.text
