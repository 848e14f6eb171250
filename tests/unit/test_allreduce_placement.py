"""Pure logic of the allreduce strategy: GPU placement, engine choice, config checks.

There is no GPU here: these tests check the decisions (which GPU a worker pins,
which engine it uses), not that NCCL actually runs.
"""
import pytest

from nbdist.config import TrainConfig
from nbdist.errors import NbdistError
from nbdist.machine.placement import (
    count_host_gpus,
    cuda_visible_devices_for_rank,
    gpu_for_local_rank,
    local_gpu_env,
)


def test_one_gpu_per_local_rank():
    assert [gpu_for_local_rank(r, 4) for r in range(4)] == [0, 1, 2, 3]
    assert [gpu_for_local_rank(r, 2) for r in range(4)] == [0, 1, 0, 1]  # more workers than GPUs: shared
    assert gpu_for_local_rank(0, 0) is None
    with pytest.raises(ValueError):
        gpu_for_local_rank(-1, 2)


def test_cuda_visible_devices_honours_the_parents_restriction():
    assert cuda_visible_devices_for_rank(1, 4, None) == "1"
    assert cuda_visible_devices_for_rank(1, 8, "2,3") == "3"
    assert cuda_visible_devices_for_rank(2, 8, " 5, 7 ") == "5"
    assert cuda_visible_devices_for_rank(0, 4, "") == ""  # the parent hid every GPU
    assert cuda_visible_devices_for_rank(0, 4, "-1") == ""
    assert cuda_visible_devices_for_rank(3, 0, None) == ""  # CPU host


def test_local_gpu_env_per_rank(tmp_path):
    assert count_host_gpus(str(tmp_path / "absent")) == 0
    for i in range(2):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    assert count_host_gpus(str(tmp_path)) == 2
    assert local_gpu_env(1, {}, gpu_count=2) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert local_gpu_env(1, {"CUDA_VISIBLE_DEVICES": "6,7"}, gpu_count=8) == {"CUDA_VISIBLE_DEVICES": "7"}
    assert local_gpu_env(0, {}, gpu_count=0) == {"CUDA_VISIBLE_DEVICES": ""}


def test_config_engine_and_strategy():
    assert TrainConfig(strategy="allreduce").engine is None
    assert TrainConfig(strategy="allreduce", engine="nccl").engine == "nccl"
    with pytest.raises(NbdistError, match="unknown engine 'mpi'"):
        TrainConfig(strategy="allreduce", engine="mpi")
    with pytest.raises(NbdistError, match="applies to --strategy allreduce"):
        TrainConfig(strategy="averaging", engine="gloo")


def test_workers_default_to_one_per_visible_gpu_and_jax_shares_without_preallocating():
    """Issue 36: with GPUs and no --workers, one worker per visible GPU, said in one line; JAX workers sharing
    a GPU allocate as they go (each would preallocate 75% of it: the first GPU run failed so), a setting of
    the user's stands, and a worker with a GPU of its own keeps JAX's default."""
    from nbdist.machine.placement import default_worker_count, jax_memory_env, visible_gpu_count, workers_per_gpu

    assert default_worker_count(0, 2) == (2, None)
    count, line = default_worker_count(4, 2)
    assert count == 4 and line.startswith("4 workers, one per visible GPU (--workers N to choose")
    assert visible_gpu_count(8, None) == 8 and visible_gpu_count(8, "2,5") == 2 and visible_gpu_count(8, "") == 0
    assert visible_gpu_count(0, "0,1") == 0
    assert [workers_per_gpu(w, 2) for w in (1, 2, 3, 4)] == [1, 1, 2, 2] and workers_per_gpu(2, 0) == 0
    assert jax_memory_env(2, 2) == {} and jax_memory_env(2, 0) == {}
    assert jax_memory_env(2, 1) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert jax_memory_env(3, 2) == {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert jax_memory_env(2, 1, {"XLA_PYTHON_CLIENT_MEM_FRACTION": ".4"}) == {}
    assert local_gpu_env(1, {}, gpu_count=1, world=2) == {"CUDA_VISIBLE_DEVICES": "0",
                                                          "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert local_gpu_env(1, {}, gpu_count=2, world=2) == {"CUDA_VISIBLE_DEVICES": "1"}


def test_the_device_a_report_names():
    from nbdist.machine.placement import describe_device, gpu_missing_notice

    assert describe_device("cpu") == "CPU" and describe_device("gpu", "3", "NVIDIA H200") == "GPU 3 (NVIDIA H200)"
    assert describe_device("cuda", None, None) == "GPU"
    assert gpu_missing_notice("nccl", "CPU").startswith("--engine nccl asks for GPUs but this worker sees none")
    assert gpu_missing_notice("nccl", "GPU 0 (NVIDIA H200)") is None and gpu_missing_notice(None, "CPU") is None
    assert gpu_missing_notice(None, "CPU", gpus_asked=True).startswith("--gpus asks for GPUs but this worker sees")
    assert gpu_missing_notice(None, "GPU 0", gpus_asked=True) is None


def test_the_local_backend_defaults_to_one_worker_per_visible_gpu(monkeypatch):
    """With GPUs (the driver's count stood in for: there are none here) and no --workers, the local backend
    starts one worker per GPU the notebook may use, and has the line that says so; without, the CPU default."""
    from nbdist.backends import local
    from nbdist.config import default_local_workers

    backend = local.LocalBackend()
    monkeypatch.setattr(local, "count_host_gpus", lambda *a: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3,5")
    assert backend.default_workers() == 3 and backend.workers_notice.startswith("3 workers, one per visible GPU")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert backend.default_workers() == 4
    monkeypatch.setattr(local, "count_host_gpus", lambda *a: 0)
    assert backend.default_workers() == default_local_workers() and backend.workers_notice is None


class _TwoRanks:
    """Rank 0 of two, whose peer's GPU identity and boot id the 'sum' adds in (no GPU here)."""
    rank, world_size, timeout = 0, 2, 10.0
    store = type("Store", (), {"host": "127.0.0.1"})()

    def __init__(self, peer: float, peer_boot: float | None = None) -> None:
        self.peer, self.peer_boot = peer, peer_boot

    def allreduce_sum(self, buf) -> None:
        import zlib

        from nbdist.strategies.shm_files import boot_id

        buf[1] += self.peer
        buf[3] += float(zlib.crc32(boot_id().encode()) | 1) if self.peer_boot is None else self.peer_boot


def test_workers_plan_from_every_workers_gpu_and_machine(monkeypatch):
    """The worker's plan (worker/device.engine_plan) sums every worker's GPU identity and boot id, so a GPU each
    gives the device sum, a shared one the host path with its line, another kernel Gloo; averaging rounds ask the
    same selector. The GPUs are stand-ins (fixed identities): none exists here."""
    import zlib

    import keras

    import nbdist.worker.device as device

    monkeypatch.setattr(device, "gpu_identity", lambda: "host/0000:01:00.0")
    other = float(zlib.crc32(b"host/0000:02:00.0") | 1)
    same = float(zlib.crc32(b"host/0000:01:00.0") | 1)
    train = TrainConfig()
    own = device.engine_plan(_TwoRanks(other), train, "allreduce", 1024, True)
    expected = "jax" if keras.backend.backend() == "jax" else "nccl"
    assert (own.engine_name, own.notice) == (expected, None)
    shared = device.engine_plan(_TwoRanks(same), train, "averaging", 1024)
    assert shared.summed_by == "shared" and shared.notice.startswith("Workers 0 and 1 share one GPU")
    apart = device.engine_plan(_TwoRanks(same, peer_boot=7.0), train.replace(engine="gloo"), "allreduce", 1024)
    assert (apart.engine_name, apart.summed_by) == ("gloo", "allreduce")
    never = device.engine_plan(_TwoRanks(other), train.replace(device_sum="never"), "averaging", 1024)
    assert never.summed_by == "shared"
