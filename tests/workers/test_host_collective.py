"""Workers of one machine meet and sum without torch (strategies/host_collective.py).

Real processes share one directory and real /dev/shm segments: their sums and broadcasts are numpy's in
rank order, bit for bit on every worker; a dead peer fails the wait naming its pid. A real training run
whose door chose the host meeting (as it does where torch is not installed) takes the local step and
leaves nothing in /dev/shm. The run without torch installed at all is the JAX-only install's tier.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile

import numpy as np
import pytest

from nbdist.strategies import shared
from nbdist.strategies.host_collective import PREFIX, DirectoryStore, remove_meeting_place

from ..conftest import mlp
from ..ranks import run_ranks

pytestmark = [pytest.mark.timeout(200),
              pytest.mark.skipif(not shared.supported_here(), reason="shared-memory sums need x86-64 and /dev/shm")]
BIG = 2**20 + 12345  # more than two of the chunked sum's chunks


def rank_arrays(rank: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return {"big": rng.normal(size=BIG).astype("float32"), "f64": rng.normal(size=7), "big64": rng.normal(size=BIG),
            "i64": rng.integers(-1000, 1000, 3), "grid": rng.normal(size=(4, 5)).astype("float32")[:, ::2]}


def digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def sum_and_broadcast(rank: int, world: int, _port: int, path: str, die_at: int) -> None:
    from nbdist.strategies.host_collective import HostCollective

    col = HostCollective(rank, world, path, timeout=30.0)
    out = {}
    try:
        arrays = rank_arrays(rank)
        for name, a in arrays.items():
            col.allreduce_sum(a)
            out[name] = digest(a)
        if rank == die_at:
            os._exit(3)  # after the segments opened: the others notice while waiting
        b = np.full(1000, float(rank), "float32")
        col.broadcast(b, root=1)
        out["broadcast"] = digest(b)
        out["summed_by"] = {str(key): type(summer).__name__ for key, summer in col._sums.items()}
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        col.close()
    print(json.dumps(out))


def expected_sums(world: int) -> dict[str, str]:
    per_rank = [rank_arrays(r) for r in range(world)]
    out = {}
    for name in per_rank[0]:
        total = per_rank[0][name].copy()
        for r in range(1, world):
            total = total + per_rank[r][name]  # rank order: the bits every worker must hold
        out[name] = digest(total)
    out["broadcast"] = digest(np.full(1000, 1.0, "float32"))
    # Large floats chunk by chunk (a float64 model's weights too: a whole copy per worker would be 2 x its size),
    # the rest in small segments.
    out["summed_by"] = {"('chunked', '<f4')": "SharedChunkedSum", "('chunked', '<f8')": "SharedChunkedSum",
                        "('<f8', 7)": "SharedMemorySum", "('<i8', 3)": "SharedMemorySum"}
    return out


def test_sums_and_broadcasts_are_numpys_in_rank_order_on_every_worker():
    path = tempfile.mkdtemp(prefix=PREFIX, dir="/dev/shm")
    try:
        reports = run_ranks("tests.workers.test_host_collective:sum_and_broadcast", 3, path, -1)
    finally:
        remove_meeting_place(path)
    assert reports == [expected_sums(3)] * 3
    assert not os.path.exists(path)


def test_a_dead_peer_fails_the_wait_with_its_pid():
    path = tempfile.mkdtemp(prefix=PREFIX, dir="/dev/shm")
    try:
        reports = run_ranks("tests.workers.test_host_collective:sum_and_broadcast", 3, path, 2, timeout=60,
                            exits={2: 3})
    finally:
        remove_meeting_place(path)
    for report in reports[:2]:
        assert "broadcast" not in report
        assert report["error"].startswith("PeerGone: worker 2 (pid "), report


def test_a_store_value_is_whole_or_absent_and_a_missing_one_times_out(tmp_path):
    store = DirectoryStore(str(tmp_path), timeout=0.3)
    store.set("nbdist/shm/1/path", "/dev/shm/x")
    assert store.get("nbdist/shm/1/path") == b"/dev/shm/x"
    assert [p.name for p in tmp_path.iterdir()] == ["nbdist%shm%1%path"]  # no temporary file left
    with pytest.raises(TimeoutError, match="collective timeout"):
        store.get("nbdist/shm/2/path")


def test_remove_meeting_place_removes_only_what_it_made(tmp_path):
    other = tmp_path / "not-ours"
    other.mkdir()
    remove_meeting_place(str(other))
    assert other.exists()


@pytest.mark.usefixtures("no_leftover_workers")
@pytest.mark.parametrize("strategy", ["allreduce", "averaging"])
def test_training_that_meets_on_the_host_takes_the_local_step(digits, monkeypatch, strategy):
    import keras

    import nbdist
    from nbdist.driver import training

    monkeypatch.setattr(training, "meeting", lambda *args: "host")  # the door's choice where torch is missing
    before = set(glob.glob(f"/dev/shm/{PREFIX}*"))
    x, y = digits[0][:400], digits[1][:400]
    def optimizer():
        return "adam" if strategy == "allreduce" else keras.optimizers.SGD(0.1)

    local, remote = mlp(0, optimizer()), mlp(0, optimizer())
    remote.set_weights(local.get_weights())
    expected = local.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0).history
    job = nbdist.train(remote, x, y, epochs=2, batch_size=32, workers=2, shuffle=False, lr_scaling="none",
                       strategy=strategy, averaging_frequency=1)
    for key, values in expected.items():
        np.testing.assert_allclose(job.history[key], values, rtol=1e-5, err_msg=key)
    for a, b in zip(remote.get_weights(), local.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert set(glob.glob(f"/dev/shm/{PREFIX}*")) == before
