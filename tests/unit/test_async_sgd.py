"""The asynchronous strategy's server logic (strategies/async_sgd.py): scaling, bounds, refusals, dealing."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from nbdist.config import TrainConfig
from nbdist.errors import NbdistError
from nbdist.strategies.async_sgd import BatchPool, SharedModel, staleness_scale


def _weights(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)]


def test_a_round_of_deltas_from_one_base_is_the_synchronous_average():
    base = _weights(0)
    trained = [[w + d for w, d in zip(base, _weights(s))] for s in (1, 2, 3)]
    server = SharedModel(base, world_size=3)
    for rank, weights in enumerate(trained):  # staleness 0, 1, 2: all within a round's N - 1
        verdict = server.push(rank, 0, 0, [t - b for t, b in zip(weights, base)], samples=10)
        assert verdict.applied and verdict.scale == pytest.approx(1 / 3)
    mean = [np.mean([t[i] for t in trained], axis=0) for i in range(len(base))]
    for got, want in zip(server.weights, mean):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert server.version == 3 and server.samples == 30


def test_staleness_beyond_a_round_damps_the_delta():
    assert staleness_scale(0, 2) == staleness_scale(1, 2) == 0.5
    assert staleness_scale(3, 2) == pytest.approx(0.5 / 3)
    server = SharedModel([np.zeros(2, np.float32)], world_size=2)
    for seq in range(3):  # the fast worker moves the model three versions on
        server.push(0, seq, server.version, [np.zeros(2, np.float32)], 8)
    verdict = server.push(1, 0, 0, [np.ones(2, np.float32)], 8)  # the slow worker's, from version 0
    assert verdict.applied and verdict.staleness == 3
    np.testing.assert_allclose(server.weights[0], [0.5 / 3, 0.5 / 3], rtol=1e-6)


def test_replayed_stale_and_malformed_updates_are_refused_and_change_nothing():
    server = SharedModel([np.zeros(2, np.float32)], world_size=2, max_staleness=2)
    one = [np.ones(2, np.float32)]
    assert server.push(0, 5, 0, one, 4).applied
    before = server.weights[0].copy()
    refused = [
        server.push(0, 5, 1, one, 4),  # the same sequence again: a replay
        server.push(0, 4, 1, one, 4),  # an older one
        server.push(1, 0, 7, one, 4),  # a version the server never had
        server.push(2, 0, 1, one, 4),  # no such worker
        server.push(1, 0, 1, [np.ones(3, np.float32)], 4),  # not the model's shapes
        server.push(1, 0, 1, [np.array([np.nan, 0], np.float32)], 4),  # diverged
    ]
    for _ in range(3):
        server.push(0, server.version + 10, server.version, [np.zeros(2, np.float32)], 4)
    refused.append(server.push(1, 0, 0, one, 4))  # 4 versions stale, over the bound of 2
    assert [v.applied for v in refused] == [False] * 7
    assert "replays" in refused[0].reason and "stale" in refused[-1].reason
    np.testing.assert_array_equal(server.weights[0], before)
    assert server.refused == 7


def test_blocks_near_an_epochs_end_follow_each_workers_speed():
    from nbdist.strategies.async_sgd import block_cap

    assert block_cap(12, 0, {}, 2) == 6  # speeds unknown: an equal share
    assert block_cap(12, 0, {0: 3.0, 1: 1.0}, 2) == 9  # three times as fast: three quarters
    assert block_cap(12, 1, {0: 3.0, 1: 1.0}, 2) == 3
    assert block_cap(1, 1, {0: 30.0, 1: 1.0}, 2) == 1  # never nothing while batches are left


def test_a_fast_worker_takes_more_of_an_epochs_batches():
    pool = BatchPool(range(10))
    dealt = {0: [], 1: []}
    dealt[1] += pool.deal(1, 2)  # the slow worker takes a block and is still on it...
    while not pool.complete:
        block = pool.deal(0, 2)  # ...while the fast one takes the rest, block after block
        dealt[0] += block
        pool.report(0)
        if not block:
            pool.report(1)
    assert sorted(dealt[0] + dealt[1]) == list(range(10)) and len(dealt[0]) == 8
    with pytest.raises(ValueError):
        busy = BatchPool(range(4))
        busy.deal(0, 2)
        busy.deal(0, 2)  # a second block before the first was reported


def test_max_staleness_is_checked_at_the_door():
    assert TrainConfig(strategy="async", max_staleness=3).max_staleness == 3
    with pytest.raises(NbdistError, match="applies to --strategy async"):
        TrainConfig(strategy="averaging", max_staleness=3)
    with pytest.raises(NbdistError, match="max_staleness must be a whole number"):
        TrainConfig(strategy="async", max_staleness=0)


def test_an_update_over_the_authenticated_wire_replayed_or_forged_is_refused():
    """A push crosses a real authenticated channel into the driver's server: the same frame's bytes again fail
    the wire's sequence check, a forged frame its MAC, and the same update re-sent in a new frame (same
    sequence number) is refused by the server, the shared weights unchanged."""
    from nbdist.driver.async_server import AsyncServer
    from nbdist.wire import protocol
    from nbdist.wire.catalog import read
    from nbdist.wire.reports import AsyncPull, AsyncPush

    from .test_protocol import Recorder, pair

    answers: list = []
    server = AsyncServer(2, batches=4, k=2, shuffle=False, seed=0,
                         send=lambda rank, shared: answers.append((rank, shared)))
    secret = protocol.new_secret()
    driver, worker = pair(secret, secret)
    worker.sock = recorder = Recorder(worker.sock)
    start = [np.zeros((2, 2), np.float32)]
    worker.send(*AsyncPull(0, True, start).encode())
    server.pull(0, read(driver.recv()))
    assert answers[-1][1].batches == [0, 1] and answers[-1][1].version == 0
    push = AsyncPush(seq=0, version=0, samples=64, epoch=0, delta=[np.ones((2, 2), np.float32)])
    worker.send(*push.encode())
    server.push(0, read(driver.recv()))
    applied = server.shared.weights[0].copy()
    np.testing.assert_allclose(applied, 0.5)  # 1/N of the delta, staleness 0
    recorder.sock.sendall(recorder.sent[-1])  # the push frame's bytes again: a replay on the wire
    with pytest.raises(protocol.ProtocolError, match="sequence"):
        driver.recv()
    driver2, worker2 = pair(secret, secret)
    worker2.sock = recorder2 = Recorder(worker2.sock)
    worker2.send(*dataclasses.replace(push, version=1).encode())  # the same update again, a fresh frame
    server.push(0, read(driver2.recv()))
    assert "replays" in answers[-1][1].refused
    np.testing.assert_array_equal(server.shared.weights[0], applied)
    forged = b'{"type":"async_push","seq":9,"version":1,"samples":64,"epoch":0,"arrays":{"delta":0}}'  # no key
    header = protocol.HEADER.pack(protocol.MAGIC, protocol.PROTOCOL_VERSION, protocol.KIND_JSON, len(recorder2.sent),
                                  len(forged))
    recorder2.sock.sendall(header + forged + b"\0" * protocol.MAC_SIZE)
    with pytest.raises(protocol.ProtocolError, match="authentication"):
        driver2.recv()


def test_array_batches_cover_every_row_once_an_epoch_in_the_same_order_on_every_worker():
    """Arrays under async: batch i of an epoch names rows of the global shuffled order, so the blocks the driver
    deals (indices only) cover every row once, whichever worker trains them."""
    from nbdist.worker.async_batches import ArrayBatches

    x = np.arange(50, dtype=np.float64).reshape(25, 2)
    y, w = np.arange(25), np.linspace(0, 1, 25).astype(np.float32)
    workers = [ArrayBatches({"a": x}, y, w, 4, True, 7) for _ in range(2)]
    assert len(workers[0]) == 7  # 6 of 4 rows and the short one
    orders = []
    for epoch in (0, 1):
        for b in workers:
            b.on_epoch_begin(epoch)
        # Dealt alternately, as a driver might: each batch read on the worker that got it.
        got = [workers[i % 2].batch(i) for i in range(len(workers[0]))]
        assert all(np.array_equal(workers[0].batch(i)[1], got[i][1]) for i in range(7))
        rows = np.concatenate([g[1] for g in got])
        assert sorted(rows.tolist()) == list(range(25)) and [len(g[1]) for g in got] == [4] * 6 + [1]
        for gx, gy, gw in got:  # x, y and weights stay row-aligned; float64 arrives as float32, as on the wire
            assert gx["a"].dtype == np.float32 and np.array_equal(gx["a"][:, 0], 2 * gy) and np.allclose(gw, w[gy])
        orders.append(rows)
    assert not np.array_equal(orders[0], orders[1])  # a fresh shuffle every epoch
    plain = ArrayBatches(x, y, None, 4, False, 7)
    plain.on_epoch_begin(3)
    assert len(plain.batch(0)) == 2 and plain.batch(1)[1].tolist() == [4, 5, 6, 7]


def test_async_refuses_what_it_cannot_deal_in_one_sentence():
    from nbdist.data.inputs import make_fit_data
    from nbdist.driver.async_server import async_refusal, plan_arrays
    from nbdist.driver.fit_call import FitRun

    data = make_fit_data(np.zeros((100, 3), np.float32), np.zeros(100))
    run = FitRun(callbacks=None, global_batch=10, rows=100, epochs=2, steps_per_epoch=3)
    assert async_refusal(data, None, run, False) == ""
    assert "Spark DataFrame or RDD" in async_refusal(object(), None, None, False)
    with pytest.raises(NbdistError, match="drop steps_per_epoch"):
        plan_arrays(run, 100, 2, 5)
    whole = FitRun(callbacks=None, global_batch=10, rows=100, epochs=2, steps_per_epoch=10)  # a whole pass: fine
    assert plan_arrays(whole, 100, 2, 5) == (5, [(0, 50), (0, 50)])
