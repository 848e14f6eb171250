"""Pure logic of the allreduce strategy: GPU placement, engine choice, config checks.

There is no GPU here: these tests check the decisions (which GPU a worker pins,
which engine it uses), not that NCCL or Horovod actually run.
"""
import pytest

from nbdist.config import TrainConfig
from nbdist.errors import NbdistError
from nbdist.placement import (
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


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_engine_on_jax_and_torch_is_gloo_and_any_other_request_is_one_sentence(backend):
    """Issue 25: only Gloo is wired on these backends (no GPU here, NCCL on torch is not built); --engine
    nccl or horovod is said once and the run goes on over Gloo, never silently."""
    from nbdist.worker.allreduce_fit import host_engine

    assert host_engine(None, backend) == ("gloo", None)
    assert host_engine("gloo", backend) == ("gloo", None)
    for requested in ("nccl", "horovod"):
        engine, warning = host_engine(requested, backend)
        assert engine == "gloo" and warning.startswith(f"--engine {requested} is not available on Keras' {backend}")
        assert warning.endswith("the gradients are summed over Gloo.") and warning.count(". ") == 0
    assert "C++17" in host_engine("horovod", "torch")[1] and "no JAX support" in host_engine("horovod", "jax")[1]
