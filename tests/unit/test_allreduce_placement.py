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


def test_engine_on_jax_is_gloo_and_any_other_request_is_one_sentence_saying_why():
    """Issue 25: JAX's gradients leave its jitted step through a host call, so only Gloo is wired there;
    --engine nccl or horovod is said once, with the reason, and the run goes on over Gloo, never silently."""
    from nbdist.worker.allreduce_fit import jax_engine

    assert jax_engine(None) == ("gloo", None)
    assert jax_engine("gloo") == ("gloo", None)
    for requested in ("nccl", "horovod"):
        engine, warning = jax_engine(requested)
        assert engine == "gloo" and warning.startswith(f"--engine {requested} is not available on Keras' jax backend")
        assert warning.endswith("the gradients are summed over Gloo.") and warning.count(". ") == 0
    assert "host call" in jax_engine("nccl")[1] and "no JAX support" in jax_engine("horovod")[1]


def test_engine_on_torch_is_nccl_when_every_worker_has_a_gpu():
    """Issue 25, torch backend: allreduce picks NCCL when every worker sees a GPU, Gloo when one lacks one;
    --engine nccl then is one sentence naming the worker; Horovod is said once and the default sums. The
    flags stand for what each worker's torch.cuda reports (no GPU here: NCCL itself has not run)."""
    from nbdist.placement import choose_torch_engine

    assert choose_torch_engine(None, [True, True]) == ("nccl", None)
    assert choose_torch_engine(None, [True, False]) == ("gloo", None)
    assert choose_torch_engine(None, [False, False]) == ("gloo", None)
    assert choose_torch_engine("nccl", [True, True, True]) == ("nccl", None)
    assert choose_torch_engine("gloo", [True, True]) == ("gloo", None)  # asked for: the host path, on GPUs too
    with pytest.raises(NbdistError, match=r"^--engine nccl needs a GPU on every worker and worker 1 has none; "
                                          r"use --engine gloo \(the default when a worker has no GPU\)\.$"):
        choose_torch_engine("nccl", [True, False])
    with pytest.raises(NbdistError, match="and workers 0, 2 have none"):
        choose_torch_engine("nccl", [False, True, False])
    for gpus, summed_by in (([True, True], "NCCL"), ([False, True], "Gloo")):
        engine, warning = choose_torch_engine("horovod", gpus)
        assert engine == summed_by.lower() and warning.startswith("--engine horovod is not available on Keras' torch")
        assert "C++17" in warning and warning.endswith(f"summed over {summed_by}.") and warning.count(". ") == 0
    with pytest.raises(NbdistError, match="unknown engine"):
        choose_torch_engine("mpi", [True, True])
