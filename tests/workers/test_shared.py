"""The shared-memory sum of small gradient buckets (strategies/shared.py).

Sums run between 2 and 3 real processes that map one real /dev/shm segment, and are compared with
numpy's; every worker must hold the same bits afterwards. Also: the segment is gone from /dev/shm
once mapped, a dead peer fails the wait with its pid named, and when one worker cannot map the
segment every worker falls back to messages together.
"""
import glob
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from nbdist.machine.processes import ProcessId
from nbdist.strategies import shared
from nbdist.strategies.shared import SharedMemorySum, row_stride, segment_bytes, should_spin

from ..ranks import run_ranks

pytestmark = [pytest.mark.timeout(150),
              pytest.mark.skipif(not shared.supported_here(), reason="shared-memory sums need x86-64 and /dev/shm")]
LENGTH = 5003


def test_spin_only_when_every_worker_has_a_core_of_its_own():
    f = frozenset
    assert should_spin([f({0}), f({1})])  # pinned, as the local backend pins
    assert should_spin([f({0, 1}), f({0, 1})])  # unpinned, a core each
    assert not should_spin([f({0, 1})] * 4)  # 4 workers on 2 cores
    assert not should_spin([f({0}), f({0})])  # pinned to the same core
    assert not should_spin([f({0, 1}), f({1, 2})])  # overlapping
    assert not should_spin([f({0}), f()])  # a worker that could not say


def test_layout_keeps_counters_and_rows_on_their_own_lines():
    assert row_stride(1) == 64 and row_stride(16) == 64 and row_stride(17) == 128
    assert segment_bytes(2, 17) == 2 * 64 + 2 * 2 * 128


def test_process_identity_tells_a_live_process_from_an_exited_one():
    me = ProcessId.of(os.getpid())
    assert me is not None and me.alive()
    assert not ProcessId(me.pid, me.start + 1).alive()  # same pid, another start: a reused pid
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        who = ProcessId.of(child.pid)
        assert who is not None and who.alive()
        child.kill()
        time.sleep(0.5)  # not reaped yet: a zombie is not alive either
        assert not who.alive()
    finally:
        child.kill()
        child.wait()


def _two_workers_in_this_process(tmp_path, spin: bool) -> tuple[SharedMemorySum, SharedMemorySum]:
    """Ranks 0 and 1 of a 3-float sum over one file mapping."""
    import mmap

    path = tmp_path / "seg"
    path.write_bytes(b"\0" * segment_bytes(2, 3))
    with open(path, "r+b") as f:
        buf = mmap.mmap(f.fileno(), 0)
    return (SharedMemorySum(0, 2, 3, buf, [None, None], timeout=5, spin=spin),
            SharedMemorySum(1, 2, 3, buf, [None, None], timeout=5, spin=False))


def test_a_single_process_sums_through_its_own_segment(tmp_path):
    # Two "workers" in one process share a mapping: enough to check slots and rank order.
    a, b = _two_workers_in_this_process(tmp_path, spin=True)
    for step in range(3):  # both slots used, then the first again
        x = np.array([1.0, 2.0, step], dtype=np.float32)
        y = np.array([10.0, 20.0, 1e8], dtype=np.float32)
        a._seq[1] = a._calls + 1  # b's turn, written by hand so a does not wait for it
        b._slots[(b._calls + 1) % 2][1] = y
        a(x)
        np.testing.assert_array_equal(x, np.array([11.0, 22.0, np.float32(step) + np.float32(1e8)], np.float32))
        b._calls += 1
    a.close()
    b.close()


def test_a_peer_one_call_ahead_does_not_overwrite_the_rows_being_read(tmp_path, monkeypatch):
    import threading

    # Worker 0 stops just before adding call 1's rows; worker 1 finishes call 1 and writes call 2's
    # bucket meanwhile. With one slot instead of two, worker 0 would add call 2's row into call 1.
    a, b = _two_workers_in_this_process(tmp_path, spin=False)
    reading, go_on = threading.Event(), threading.Event()
    add = shared.add_in_rank_order

    def add_slowly_on_worker_0(rows, out):
        if threading.current_thread().name == "worker0" and not go_on.is_set():
            reading.set()
            assert go_on.wait(10)
        add(rows, out)

    monkeypatch.setattr(shared, "add_in_rank_order", add_slowly_on_worker_0)
    results: dict[str, list] = {"worker0": [], "worker1": []}

    def run(summer, buckets):
        for bucket in buckets:
            summer(bucket)
            results[threading.current_thread().name].append(bucket.copy())

    ones, twos = np.ones(3, np.float32), np.full(3, 2.0, np.float32)
    t0 = threading.Thread(target=run, name="worker0", args=(a, [ones.copy(), ones.copy()]))
    t1 = threading.Thread(target=run, name="worker1", args=(b, [twos.copy(), 100 * twos]))
    t0.start()
    t1.start()
    assert reading.wait(10)
    deadline = time.monotonic() + 10
    while int(b._seq[1]) < 2 and time.monotonic() < deadline:  # worker 1 has published call 2
        time.sleep(0.01)
    assert int(b._seq[1]) == 2
    go_on.set()
    t0.join(10)
    t1.join(10)
    assert [r.tolist() for r in results["worker0"]] == [[3.0] * 3, [201.0] * 3]
    assert [r.tolist() for r in results["worker1"]] == [[3.0] * 3, [201.0] * 3]
    a.close()
    b.close()


def _bucket(rank, step):
    return np.random.default_rng(100 * rank + step).standard_normal(LENGTH).astype(np.float32)


def _segments() -> list[str]:
    return sorted(glob.glob(os.path.join(shared.SHM_DIR, "nbdist-*")))


def _rank_main(rank: int, world: int, port: int, mode: str) -> None:
    from nbdist.strategies.collective import GlooCollective

    gloo = GlooCollective(rank, world, "127.0.0.1", port, timeout=60)
    if mode == "no-map" and rank == world - 1:
        shared._attach = lambda path, size: None  # as if this worker ran in another container
    if mode == "other-kernel" and rank == world - 1:
        shared.boot_id = lambda: "another-machine"  # its own /dev/shm and pids may still look alike
    if mode == "no-segment" and rank == 0:
        shared.supported_here = lambda: False  # as on a machine without x86-64 ordering
    summer = shared.open_shared_sum(gloo, LENGTH)
    report = {"shared": summer is not None, "spin": getattr(summer, "spin", None)}
    if summer is not None:
        if mode == "sleep":
            summer.spin = False
        gloo.allreduce_sum(np.zeros(1, np.float32))  # rank 0 has unlinked the segment by now
        report["left_in_shm"] = _segments()
        errors, digests = [], []
        for step in range(6):
            if mode == "peer-dies" and rank == 1 and step == 2:
                os._exit(3)
            bucket = _bucket(rank, step)
            if rank == 0 and step == 3:
                time.sleep(0.1)  # the others wait past their spin and sleep
            t0 = time.monotonic()
            try:
                summer(bucket)
            except shared.PeerGone as exc:
                report["error"], report["after"] = str(exc), time.monotonic() - t0
                break
            want = sum(_bucket(r, step).astype(np.float64) for r in range(world))
            errors.append(float(np.abs(bucket - want).max()))
            digests.append(hashlib.sha256(bucket.tobytes()).hexdigest())
        report.update(errors=errors, digests=digests)
        summer.close()
    print(json.dumps(report), flush=True)
    if mode != "peer-dies":
        gloo.close()


@pytest.mark.parametrize("world,mode", [pytest.param(2, "spin", marks=pytest.mark.full("the 3-spin case")), (3, "spin"),
                                        (2, "sleep")])
def test_shared_sum_between_real_processes_equals_numpy_with_the_same_bits_everywhere(world, mode):
    before = _segments()
    reports = run_ranks("tests.workers.test_shared:_rank_main", world, mode)
    for report in reports:
        assert report["shared"]
        assert len(report["errors"]) == 6 and max(report["errors"]) < 1e-5
    assert all(r["digests"] == reports[0]["digests"] for r in reports)
    # Unlinked as soon as every worker had mapped it: nothing is left even if a worker is killed.
    assert all(set(r["left_in_shm"]) <= set(before) for r in reports)
    assert _segments() == before


@pytest.mark.parametrize("mode", ["no-map", "no-segment"])
def test_when_one_worker_cannot_map_the_segment_all_use_messages(mode):
    before = _segments()
    reports = run_ranks("tests.workers.test_shared:_rank_main", 3, mode, timeout=60)
    assert [r["shared"] for r in reports] == [False, False, False]
    assert _segments() == before


def test_workers_on_two_kernels_never_share_memory():
    """Namespaces or containers of two machines may see alike /dev/shm and pids: the boot id tells them apart."""
    reports = run_ranks("tests.workers.test_shared:_rank_main", 2, "other-kernel", timeout=60)
    assert [r["shared"] for r in reports] == [False, False]


def test_a_peer_that_dies_fails_the_wait_naming_it():
    procs, outs = _two_ranks("_rank_main", "peer-dies")
    assert procs[1].returncode == 3
    report = json.loads(outs[0][0].strip().splitlines()[-1])
    assert report["errors"] and len(report["errors"]) == 2  # steps 0 and 1 summed before the death
    assert report["error"] == f"worker 1 (pid {procs[1].pid}) exited during the gradient exchange"
    assert report["after"] < 5


# -- the chunked sum of large buckets (SharedChunkedSum) ------------------------------------------
CHUNK = 1024  # floats per row: buckets of a few chunks, none a multiple of it
# A layout like the allreduce's: three gradients at 64-byte aligned offsets (gaps between them), the count last.
SIZES = [2500, 7, 1301]


def _arrays(rank, step):
    rng = np.random.default_rng(1000 * rank + step)
    return [rng.standard_normal(n).astype(np.float32) for n in SIZES] + [np.array([rank + 1.0], np.float32)]


def _chunked_rank_main(rank: int, world: int, port: int, mode: str) -> None:
    from nbdist.strategies.collective import GlooCollective
    from nbdist.strategies.shared import aligned_offsets

    gloo = GlooCollective(rank, world, "127.0.0.1", port, timeout=60)
    offsets = aligned_offsets(SIZES + [1])
    length = int(offsets[-1])
    summer = shared.open_chunked_sum(gloo, length, CHUNK)
    report = {"shared": summer is not None}
    gloo.allreduce_sum(np.zeros(1, np.float32))  # rank 0 has unlinked the segment by now
    report["left_in_shm"] = _segments()
    plan = summer.plan([int(o) for o in offsets[:-1]], SIZES + [1], length)
    errors, digests = [], []
    out = np.full(length, np.nan, np.float32)
    for step in range(5):
        if mode == "peer-dies" and rank == 1 and step == 2:
            os._exit(3)
        if rank == 0 and step == 3:
            time.sleep(0.1)  # the others wait past their spin and sleep
        t0 = time.monotonic()
        arrays = _arrays(rank, step)
        # Scaled as they are copied in (the gradients' factor n / total; 0 for a worker with no rows), the count not.
        factor = np.float32(0.0 if step == 4 and rank == 1 else 0.375 + rank) if mode == "scaled" else None
        scales = None if factor is None else [factor] * len(SIZES) + [None]
        try:
            if step % 2:  # in place, as the averaging strategy sums its buffer
                bucket = np.concatenate(arrays)
                summer(bucket)
                got = np.split(bucket, np.cumsum(SIZES + [1])[:-1])
            else:  # from the arrays where they are into the bucket, as the gradients are summed
                summer.sum_into(arrays, out, plan, scales)
                got = [out[o:o + n] for o, n in zip(offsets[:-1], SIZES + [1])]
        except shared.PeerGone as exc:
            report["error"], report["after"] = str(exc), time.monotonic() - t0
            break
        # The same additions in the same order as the one-row sum: compare bits, not just values.
        want = [np.zeros(n, np.float32) for n in SIZES + [1]]
        rows = [_arrays(r, step) for r in range(world)]
        if scales is not None and step % 2 == 0:
            factors = [np.float32(0.0 if step == 4 and r == 1 else 0.375 + r) for r in range(world)]
            rows = [[a * f for a in row[:-1]] + row[-1:] for row, f in zip(rows, factors)]
        for i in range(len(want)):
            shared.add_in_rank_order(np.stack([row[i] for row in rows]), want[i])
        errors.append(sum(int(np.count_nonzero(g != w)) for g, w in zip(got, want)))
        digests.append(hashlib.sha256(b"".join(g.tobytes() for g in got)).hexdigest())
    report.update(errors=errors, digests=digests, chunks=len(plan.chunks))
    summer.close()
    print(json.dumps(report), flush=True)
    if mode != "peer-dies":
        gloo.close()


@pytest.mark.parametrize("world, mode", [pytest.param(2, "run", marks=pytest.mark.full("the 3-run case")), (3, "run"),
                                         (3, "scaled")])
def test_chunked_sum_between_real_processes_is_the_rank_order_sum_with_the_same_bits_everywhere(world, mode):
    """"scaled": the gradients scaled as they are copied in."""
    before = _segments()
    reports = run_ranks("tests.workers.test_shared:_chunked_rank_main", world, mode)
    for report in reports:
        assert report["shared"] and report["chunks"] == 4  # 3853 floats: 3 whole chunks and a part
        assert report["errors"] == [0] * 5  # bit for bit the sum added in rank order, both call forms
    assert all(r["digests"] == reports[0]["digests"] for r in reports)
    assert all(set(r["left_in_shm"]) <= set(before) for r in reports)
    assert _segments() == before


def test_a_peer_that_dies_during_a_chunked_sum_fails_the_survivor_naming_it():
    before = _segments()
    procs, outs = _two_ranks("_chunked_rank_main", "peer-dies")
    assert procs[1].returncode == 3
    report = json.loads(outs[0][0].strip().splitlines()[-1])
    assert report["errors"] == [0, 0]  # steps 0 and 1 summed before the death
    assert report["error"] == f"worker 1 (pid {procs[1].pid}) exited during the gradient exchange"
    assert report["after"] < 5
    assert _segments() == before


def test_chunked_segment_keeps_two_slots_of_world_plus_one_rows():
    assert shared.chunked_segment_bytes(2, 16) == 2 * 64 + 2 * 3 * 64
    plan = shared.chunk_plan([0, 2512], [2500, 7], 2519, 1024, rank=1, world=2)
    assert [(a, b, lo, hi) for a, b, _, lo, hi in plan.chunks] == [(0, 1024, 512, 1024), (1024, 2048, 512, 1024),
                                                                  (2048, 2519, 240, 471)]
    assert plan.chunks[2][2] == [(0, 2048, 2500, 2048), (1, 0, 7, 2512)]


def _two_ranks(entry: str, mode: str) -> tuple[list[subprocess.Popen], list[tuple[str, str]]]:
    """Ranks 0 and 1 of this module's ``entry`` (``_rank_main``, ``_chunked_rank_main``) in ``mode``, as
    processes of their own; their exit and output."""
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TF_CPP_MIN_LOG_LEVEL": "3"}
    code = (f"import sys; from tests.workers.test_shared import {entry}; "
            f"{entry}(int(sys.argv[1]), 2, int(sys.argv[2]), {mode!r})")
    port = socket_port()
    procs = [subprocess.Popen([sys.executable, "-c", code, str(r), str(port)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    return procs, [p.communicate(timeout=60) for p in procs]


def socket_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _threads_rank_main(rank: int, world: int, port: int, backend: str) -> None:
    import torch

    os.environ["KERAS_BACKEND"] = backend
    from nbdist.strategies.collective import GlooCollective

    torch.set_num_threads(2)  # the worker's budget (runtime.pin_threads)
    gloo = GlooCollective(rank, world, "127.0.0.1", port, timeout=60)
    print(json.dumps({"torch_threads": torch.get_num_threads()}), flush=True)
    gloo.close()


@pytest.mark.parametrize("backend, threads", [("torch", 2), ("tensorflow", 1)])
def test_the_collective_leaves_a_torch_workers_threads_to_its_model(backend, threads):
    """On Keras' torch backend torch's threads compute the model: opening Gloo must not cut them to one (it did,
    so every worker of 2 or more trained on one core whatever its budget); elsewhere torch only carries Gloo."""
    reports = run_ranks("tests.workers.test_shared:_threads_rank_main", 1, backend)
    assert reports[0]["torch_threads"] == threads
