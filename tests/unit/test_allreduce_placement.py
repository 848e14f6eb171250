"""Pure logic of the allreduce strategy: GPU placement, engine choice, config checks.

There is no GPU here: these tests check the decisions (which GPU a worker pins,
which engine it uses), not that NCCL or Horovod actually run.
"""
import pytest

from nbdist.config import TrainConfig
from nbdist.errors import NbdistError
from nbdist.machine.placement import (
    choose_engine,
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


def test_engine_choice():
    assert choose_engine(None, has_gpu=False, horovod_error=None) == ("gloo", None)
    assert choose_engine(None, has_gpu=True, horovod_error=None) == ("nccl", None)
    assert choose_engine("gloo", has_gpu=True, horovod_error=None) == ("gloo", None)
    assert choose_engine("horovod", has_gpu=True, horovod_error=None) == ("horovod", None)
    engine, warning = choose_engine("horovod", has_gpu=False, horovod_error="ModuleNotFoundError: horovod")
    assert engine == "gloo" and "Horovod cannot be imported" in warning and "default engine, gloo" in warning
    with pytest.raises(NbdistError, match="--engine nccl needs a GPU"):
        choose_engine("nccl", has_gpu=False, horovod_error=None)
    with pytest.raises(NbdistError, match="unknown engine"):
        choose_engine("mpi", has_gpu=False, horovod_error=None)


def test_config_engine_and_strategy():
    assert TrainConfig(strategy="allreduce").engine is None
    assert TrainConfig(strategy="allreduce", engine="nccl").engine == "nccl"
    with pytest.raises(NbdistError, match="unknown engine 'mpi'"):
        TrainConfig(strategy="allreduce", engine="mpi")
    with pytest.raises(NbdistError, match="applies to --strategy allreduce"):
        TrainConfig(strategy="averaging", engine="gloo")


def test_engine_on_jax_is_gloo_and_any_other_request_is_one_sentence_saying_why():
    """Issue 25: on JAX the default sums through a host call over Gloo; --engine nccl or horovod is said once,
    with the reason, and the run goes on over Gloo, never silently."""
    from nbdist.machine.placement import choose_jax_engine
    from nbdist.worker.allreduce_fit import jax_engine

    assert jax_engine(None) == ("gloo", None)
    assert jax_engine("gloo") == ("gloo", None)
    for requested in ("nccl", "horovod"):
        engine, warning = choose_jax_engine(requested)
        assert engine == "gloo" and warning.startswith(f"--engine {requested} is not available on Keras' jax backend")
        assert warning.endswith("the gradients are summed over Gloo.") and warning.count(". ") == 0
    assert "--engine jax" in choose_jax_engine("nccl")[1] and "no JAX support" in choose_jax_engine("horovod")[1]


def test_engine_jax_is_chosen_by_name_with_equal_steps_and_a_gpu_of_its_own_per_worker():
    """Issue 36: --engine jax (the sum inside the jitted step over JAX's collectives) by name, on CPUs and on
    GPUs; it needs the same rows per step on every worker (one program on every process) and, where workers
    have GPUs, one each (XLA sums over NCCL, which refuses two ranks on one device); otherwise one sentence
    and Gloo. On TensorFlow and torch it is refused in one sentence naming the fix."""
    from nbdist.machine.placement import ENGINES, choose_engine, choose_jax_engine, choose_torch_engine

    assert "jax" in ENGINES
    assert TrainConfig(strategy="allreduce", engine="jax").engine == "jax"
    assert choose_jax_engine("jax") == ("jax", None)
    assert choose_jax_engine("jax", True, [0, 0]) == ("jax", None)  # CPU workers: JAX's Gloo collectives
    assert choose_jax_engine("jax", True, [11, 12]) == ("jax", None)  # a GPU each
    assert choose_jax_engine("gloo", True, [11, 12]) == ("gloo", None)  # the host path, asked by name
    engine, warning = choose_jax_engine("jax", True, [11, 11])
    assert engine == "gloo" and "workers 0 and 1 share one GPU" in warning and warning.count(". ") == 0
    engine, warning = choose_jax_engine("jax", True, [11, 0])
    assert engine == "gloo" and "worker 1 has no GPU" in warning
    engine, warning = choose_jax_engine("jax", False)
    assert engine == "gloo" and warning.startswith("--engine jax needs the same rows per step on every worker")
    for refuse in (lambda: choose_engine("jax", False, None), lambda: choose_torch_engine("jax", [0, 0])):
        with pytest.raises(NbdistError, match="needs Keras' jax backend"):
            refuse()


def test_engine_on_jax_defaults_to_the_device_sum_only_where_every_worker_has_a_gpu_of_its_own():
    """Issue 36: on JAX with a GPU per worker the default sums inside the jitted step (the host call copies
    every gradient off the GPU and back: 133x plain fit's epoch on the first GPU run); on CPUs the host path
    stays (measured faster there); GPUs shared or missing, or unequal rows per step, fall back to it with one
    line saying what it costs, never the --engine wording of a request the user did not make."""
    from nbdist.machine.placement import choose_jax_engine

    assert choose_jax_engine(None, None, [11, 12]) == ("jax", None)  # decided before the rows are known
    assert choose_jax_engine(None, True, [11, 12, 13]) == ("jax", None)
    assert choose_jax_engine(None, True, []) == ("gloo", None)
    assert choose_jax_engine(None, True, [0, 0]) == ("gloo", None)  # CPU workers: no notice
    for gpus, clause in (([11, 11], "workers 0 and 1 share one GPU"), ([11, 0], "worker 1 has no GPU")):
        engine, warning = choose_jax_engine(None, True, gpus)
        assert engine == "gloo" and warning.startswith(clause[0].upper() + clause[1:]) and "host memory" in warning
        assert "--engine" not in warning and warning.count(". ") == 0
    engine, warning = choose_jax_engine(None, False, [11, 12])
    assert engine == "gloo" and "same rows per step" in warning and "--engine" not in warning
    assert "host memory" in warning and warning.count(". ") == 0


def test_engine_on_torch_is_nccl_only_when_every_worker_has_a_gpu_of_its_own():
    """Issues 25 and 36, torch backend: allreduce picks NCCL when every worker has a GPU of its own, Gloo when
    one lacks one or two share one (NCCL refuses two ranks on one device: "invalid usage", as the first GPU
    run crashed), said in one line where there are GPUs; --engine nccl then is one sentence naming the
    workers; Horovod is said once and the default sums. The identities stand for what each worker's
    torch.cuda reports (worker/device.py; no GPU here: NCCL itself has not run)."""
    from nbdist.machine.placement import choose_torch_engine

    assert choose_torch_engine(None, ["h/0", "h/1"]) == ("nccl", None)
    assert choose_torch_engine(None, [0, 0]) == ("gloo", None)  # CPU workers: nothing to say
    engine, notice = choose_torch_engine(None, ["h/0", 0])
    assert engine == "gloo" and notice.startswith("Worker 1 has no GPU, and NCCL needs a GPU of its own")
    engine, notice = choose_torch_engine(None, ["h/0", "h/1", "h/0"])  # three workers on two GPUs
    assert engine == "gloo" and notice == (
        "Workers 0 and 2 share one GPU, and NCCL needs a GPU of its own for every worker: the gradients are "
        "summed over Gloo, through host memory (each step copies them off the GPU and back).")
    assert choose_torch_engine(None, ["a/0", "b/0"]) == ("nccl", None)  # two hosts' device 0: two GPUs
    assert choose_torch_engine("nccl", ["h/0", "h/1", "h/2"]) == ("nccl", None)
    assert choose_torch_engine("gloo", ["h/0", "h/1"]) == ("gloo", None)  # asked for: the host path, on GPUs too
    with pytest.raises(NbdistError, match=r"^--engine nccl needs a GPU of its own for every worker and worker 1 "
                                          r"has no GPU; use --engine gloo \(the default then\), or give each "
                                          r"worker its own GPU \(--workers at most the GPUs\)\.$"):
        choose_torch_engine("nccl", ["h/0", 0])
    with pytest.raises(NbdistError, match="and workers 0, 2 have no GPU"):
        choose_torch_engine("nccl", [0, "h/0", 0])
    with pytest.raises(NbdistError, match="and workers 0 and 1 share one GPU"):
        choose_torch_engine("nccl", ["h/0", "h/0"])
    for gpus, summed_by in ((["h/0", "h/1"], "NCCL"), ([0, "h/1"], "Gloo"), (["h/0", "h/0"], "Gloo")):
        engine, warning = choose_torch_engine("horovod", gpus)
        assert engine == summed_by.lower() and warning.startswith("--engine horovod is not available on Keras' torch")
        assert "C++17" in warning and warning.endswith(f"summed over {summed_by}.") and warning.count(". ") == 0
    with pytest.raises(NbdistError, match="unknown engine"):
        choose_torch_engine("mpi", [True, True])


def test_tensorflow_keeps_nccl_only_where_each_worker_has_its_own_gpu():
    """TensorFlow's engine is chosen by each worker from its own GPU; checked against every worker's."""
    from nbdist.machine.placement import nccl_or_gloo

    assert nccl_or_gloo("nccl", None, None, ["h/0", "h/1"]) == ("nccl", None)
    engine, notice = nccl_or_gloo("nccl", None, None, ["h/0", "h/0"])
    assert engine == "gloo" and notice.startswith("Workers 0 and 1 share one GPU")
    assert nccl_or_gloo("gloo", None, None, ["h/0", "h/0"]) == ("gloo", None)
    with pytest.raises(NbdistError, match="and workers 0 and 1 share one GPU"):
        nccl_or_gloo("nccl", None, "nccl", ["h/0", "h/0"])


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
    """Rank 0 of two, whose peer's GPU identity the 'sum' adds in: the collective worker_gpus runs (no GPU here)."""
    rank, world_size = 0, 2

    def __init__(self, peer: float) -> None:
        self.peer = peer

    def allreduce_sum(self, buf) -> None:
        buf[1] += self.peer


def test_jax_worker_asks_every_workers_gpu_when_no_engine_is_named(monkeypatch):
    """Issue 36: the JAX worker's engine (worker/allreduce_fit.jax_engine) sums the workers' GPU identities for
    the default too, so a GPU each gives the device sum and a shared one the host path with its line. The GPU
    is a stand-in (a fixed identity): none exists here."""
    import zlib

    import nbdist.worker.device as device
    from nbdist.worker.allreduce_fit import jax_engine

    monkeypatch.setattr(device, "gpu_identity", lambda: "host/0000:01:00.0")
    other = float(zlib.crc32(b"host/0000:02:00.0") | 1)
    same = float(zlib.crc32(b"host/0000:01:00.0") | 1)
    assert jax_engine(None, _TwoRanks(other)) == ("jax", None)
    engine, warning = jax_engine(None, _TwoRanks(same))
    assert engine == "gloo" and warning.startswith("Workers 0 and 1 share one GPU")
    assert jax_engine("gloo", _TwoRanks(other)) == ("gloo", None)
    monkeypatch.setattr(device, "gpu_identity", lambda: "")
    assert jax_engine(None, _TwoRanks(0.0)) == ("gloo", None)


def test_averaging_rounds_run_on_the_devices_only_with_a_gpu_each_and_never_where_the_user_set_0(monkeypatch):
    """Issue 36: the averaging strategy's rounds (worker/device.py) join the JAX job and average on the GPUs where
    every worker has one of its own; a shared GPU, or none, keeps the host's rounds; NBDIST_<BACKEND>_DEVICE_SUM=0
    keeps them too, decided before any collective (the way back should a GPU's rounds misbehave). The GPUs are
    stand-ins (fixed identities) and the JAX job is not joined: none of it exists here."""
    import zlib

    import nbdist.strategies.jax_device_sum as jax_device_sum
    import nbdist.worker.device as device

    joined: list[bool] = []
    monkeypatch.setattr(jax_device_sum, "join_jax_job", lambda model, coll, host, limit, on_gpu: joined.append(on_gpu))
    monkeypatch.setattr(jax_device_sum, "JaxDeviceAverage", lambda model, variables: ("on the devices", variables))
    monkeypatch.setattr(device, "gpu_identity", lambda: "host/0000:01:00.0")
    for name in device.DEVICE_SUM_VARIABLES.values():
        monkeypatch.delenv(name, raising=False)

    class TwoRanksWithStore(_TwoRanks):
        store = type("Store", (), {"host": "127.0.0.1"})()

    own = float(zlib.crc32(b"host/0000:02:00.0") | 1)
    shared = float(zlib.crc32(b"host/0000:01:00.0") | 1)
    assert device.jax_device_averager(TwoRanksWithStore(own), None, ["v"], 10.0) == ("on the devices", ["v"])
    assert joined == [True]
    assert device.jax_device_averager(TwoRanksWithStore(shared), None, ["v"], 10.0) is None

    class NoCollective:
        rank, world_size = 0, 2

        def allreduce_sum(self, buf) -> None:
            raise AssertionError("no collective may run before the choice")

    for name in device.DEVICE_SUM_VARIABLES.values():
        monkeypatch.setenv(name, "0")
    assert device.jax_device_averager(NoCollective(), None, ["v"], 10.0) is None
    assert device.device_averager(NoCollective(), ["v"]) is None  # this process's Keras backend: torch or TensorFlow
    for name in device.DEVICE_SUM_VARIABLES.values():
        monkeypatch.delenv(name)
    monkeypatch.setattr(device, "gpu_identity", lambda: "")
    assert device.jax_device_averager(TwoRanksWithStore(0.0), None, ["v"], 10.0) is None  # CPUs: the host's rounds
    assert joined == [True]
