"""Keras on JAX and torch (issue 25): a notebook on either backend trains, evaluates and predicts with its
workers on the same backend, with the same meaning as locally. Real worker processes, digits.

Each backend runs in a driver process of its own (``backend_driver.py``: Keras reads KERAS_BACKEND once,
at its first import), which prints its results; this module checks them. One driver per backend runs every
phase this module checks, one after the other, as one notebook session would (``driven``). The TensorFlow
backend is what every other worker test runs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from nbdist.backends.command import package_root, worker_env

pytestmark = pytest.mark.usefixtures("no_leftover_workers")

DRIVER = Path(__file__).with_name("backend_driver.py")
ROWS = 512  # backend_driver.py's digits rows


# The phases of one driver per backend, in this order: the seeded cell's phase imports TensorFlow in the
# notebook (keras.utils.set_random_seed does, as locally), which the others check it never does, so it is last.
PHASES = {"jax": ("core", "more", "other_apis", "jax_engine", "seeded"),
          "torch": ("core", "more", "lazy_loader", "other_apis", "device_sum", "seeded")}
# Phases only `make test-full` runs (their test's case is marked full): JAX's "more" repeats torch's cases
# through JAX's own step, 25 s of compiling.
FULL_ONLY = {("jax", "more")}


def run_driver(backend: str, phase: str = "core", *more: str, cache_home: Path | None = None,
               timeout: float = 540) -> dict:
    """The driver's result; ``phase``: one phase, or several joined by commas (then a dict by phase);
    ``cache_home``: the user's cache directory of the notebook and its workers."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (package_root(), os.environ.get("PYTHONPATH"))
                                                       if p)}
    if cache_home is not None:
        env["XDG_CACHE_HOME"] = str(cache_home)
    env.pop("KERAS_BACKEND", None)  # the driver sets its own, as a notebook would before importing Keras
    done = subprocess.run([sys.executable, str(DRIVER), backend, phase, *more], env=env, capture_output=True, text=True,
                          timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("NBDIST-RESULT ")]
    assert done.returncode == 0 and lines, f"driver failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(lines[-1].removeprefix("NBDIST-RESULT "))


@pytest.fixture(scope="module")
def driven(tmp_path_factory, pytestconfig) -> Callable[[str, str], dict]:
    """``driven(backend, phase)``: that phase's result from the backend's one driver run (``PHASES``, less
    ``FULL_ONLY`` without --full), started by the first test that asks for the backend; the driver's workers keep
    their JAX programs under a cache directory of its own (the seeded phase reads it)."""
    runs: dict[str, dict] = {}
    full = pytestconfig.getoption("--full")

    def result(backend: str, phase: str) -> dict:
        if backend not in runs:
            phases = [p for p in PHASES[backend] if full or (backend, p) not in FULL_ONLY]
            runs[backend] = run_driver(backend, ",".join(phases), timeout=840,
                                       cache_home=tmp_path_factory.mktemp(f"cache-{backend}"))
        outcome = runs[backend][phase]
        assert "error" not in outcome, f"the {backend} driver's {phase} phase raised:\n{outcome['error']}"
        return outcome

    return result


def assert_remote_run(result: dict, backend: str) -> None:
    """A ``spark`` or ``containers`` phase: allreduce equal to the local fit, evaluate to model.evaluate,
    the notebook's backend on every worker."""
    assert result["backend"] == backend and result["reports"] == [backend, backend], result["reports"]
    assert_same_history(result["history"], result["expected"])
    assert result["weight_gap"] < 1e-5, result["weight_gap"]
    got, expected = result["evaluate"]["got"], result["evaluate"]["expected"]
    for key in ("loss", "accuracy"):
        assert abs(got[key] - expected[key]) <= 1e-6 * max(1.0, abs(expected[key])), (key, got, expected)
    assert not result["driver_tensorflow_end"]


def assert_same_history(got: dict, expected: dict, rtol: float = 1e-5) -> None:
    assert set(expected) <= set(got), (sorted(expected), sorted(got))
    for key, values in expected.items():
        np.testing.assert_allclose(got[key], values, rtol=rtol, atol=1e-7, err_msg=key)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_notebook_on_jax_or_torch_trains_evaluates_and_predicts_as_locally(backend, driven):
    """C25: %%dist_train with the cell's own fit (allreduce, Adam) and nbdist.train (averaging every step,
    SGD) equal the local fit on the global batch to 1e-5, history and weights; evaluate's merged metrics
    equal model.evaluate; predict equals model.predict; --strategy async trains (issue 38); the workers ran
    the notebook's backend and never imported TensorFlow."""
    result = driven(backend, "core")
    assert result["backend"] == backend
    for strategy in ("allreduce", "averaging"):
        run = result[strategy]
        assert_same_history(run["history"], run["expected"])
        assert run["weight_gap"] < 1e-5, (strategy, run["weight_gap"])
    reports = result["averaging"]["reports"]
    assert len(reports) == 2
    assert all(r == {"keras_backend": backend, "tensorflow_loaded": False} for r in reports.values()), reports
    got, expected = result["evaluate"]["got"], result["evaluate"]["expected"]
    for key in ("loss", "accuracy"):
        assert abs(got[key] - expected[key]) <= 1e-6 * max(1.0, abs(expected[key])), (key, got, expected)
    assert result["predict_gap"] < 1e-6
    # Issue 38: --strategy async on arrays trains on this backend; the model holds the last validated shared weights.
    run = result["async"]
    assert run["status"] == "done" and min(run["pushed"]) > 0 and run["reports"] == [[backend, False]] * 2, run
    assert len(run["val_accuracy"]) == 3 and run["val_accuracy"][-1] > 0.7, run
    assert abs(run["accuracy"] - run["val_accuracy"][-1]) <= 1e-6, run
    assert not result["driver_tensorflow_end"]  # the notebook's own process never imported TensorFlow either


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", [pytest.param("jax", marks=pytest.mark.full(
    "the same cases through a non-TensorFlow backend's hook: the torch case")), "torch"])
def test_the_paths_that_differ_per_backend(backend, driven):
    """C25, one run per backend: 1 worker equals the local fit; a small CNN under allreduce with
    EarlyStopping(restore_best_weights=True) stops where the local fit stops, with its weights; a subclassed model
    with its own train_step for the backend (torch: backward then optimizer.apply; JAX: stateless, value_and_grad
    then stateless_apply) under allreduce equals the local fit; evaluate's loss, accuracy and AUC equal
    model.evaluate to 1e-6; worker 1 killed after epoch 2 with --max-restarts 1 resumes from the checkpoint and
    --resume continues it, both where the local fit is; a PyDataset in the cell's fit (a shorter share padding, a
    PyDataset as validation data) equals the local fit of joined batches; two masked losses
    (Embedding(mask_zero=True), Masking) under allreduce, each worker's half of a batch holding its own number of
    valid timesteps, are normalised by the global batch's valid entries as the local fit's (weights and every
    History entry to 1e-5; each worker's own normalisation was 2e-3 away), on torch under jit_compile=True
    (torch.compile traces the step; nbdist's sums run eagerly); mixed_float16 (its loss scale) and mixed_bfloat16
    under allreduce equal the local fit to their precision; the notebook never imported TensorFlow."""
    result = driven(backend, "more")
    assert result["backend"] == backend
    # Issue 36: one allreduce worker is Keras' own step (no hook, no host copy, no collective), on the device
    # it names; the model's pickle holds no torch tensor.
    solo = result["one_allreduce_worker"]
    assert solo["report"] == ["none", 0, "CPU"] and solo["state_device"] == "CPU", solo
    assert result["graph_torch_names"] == []
    for case in ("one_worker", "one_allreduce_worker", "cnn", "own_step", "py_dataset", "masked"):
        run = result[case]
        assert_same_history(run["history"], run["expected"])
        assert run["weight_gap"] < 1e-5, (case, run["weight_gap"])
    # Issue 36: mixed precision keeps its meaning (float16 compute, the loss scale's state summed alike).
    # Measured on the CPU (SGD, one epoch): float16 1.5e-5-1.8e-5, bfloat16 6e-5-1e-4 from the local fit: the
    # rounding of a gradient summed over 32 rows twice instead of 64 once, at the compute dtype's precision.
    for policy, compute, tol in (("mixed_float16", "float16", 2e-4), ("mixed_bfloat16", "bfloat16", 1e-3)):
        run = result["mixed"][policy]
        assert run["compute_dtype"] == compute, run
        assert_same_history(run["history"], run["expected"], rtol=tol)
        assert run["weight_gap"] < tol, (policy, run["weight_gap"])
    scales = result["mixed"]["mixed_float16"]["loss_scale"]
    assert result["mixed"]["mixed_float16"]["optimizer"] == "LossScaleOptimizer" and len(scales) == 2
    assert scales[0] == scales[1], scales
    cnn = result["cnn"]
    assert len(cnn["expected"]["loss"]) < 8  # EarlyStopping did stop (the history equality says when)
    assert abs(cnn["accuracy"] - cnn["local_accuracy"]) <= 0.01
    got, expected = result["evaluate_auc"]["got"], result["evaluate_auc"]["expected"]
    for key in ("loss", "accuracy", "auc"):
        assert abs(got[key] - expected[key]) <= 1e-6 * max(1.0, abs(expected[key])), (key, got, expected)
    restart = result["restart"]
    assert restart["status"] == "done" and restart["restarts"] == 1 and restart["killed"] == 1, restart
    assert restart["weight_gap"] < 1e-4, restart
    assert restart["resumed_initial_epoch"] == 4 and restart["resumed_epochs"] == 1, restart
    assert restart["resumed_gap"] < 1e-4, restart
    assert not result["driver_tensorflow_end"]


@pytest.mark.timeout(900)
def test_torch_device_sum_overlapped_with_backward_equals_it_at_apply_the_numpy_exchange_and_the_local_fit(driven):
    """Issue 36, torch: 2 workers summing their gradients as torch tensors (Gloo here, NCCL's code) in 4
    buckets started during the backward pass (the default: "device-overlapped") train the same weights as
    the buckets started at apply (overlap=False) and as the numpy exchange, to 1e-6, and the local
    fit to 1e-5, with a pad step per epoch on one worker; the notebook's model holds no hook; Keras' own step
    (plain, LossScaleOptimizer, gradient_accumulation_steps=2) in one process on a one-rank group: every
    step's early buckets held the gradients apply got (none summed again), the weights equal the plain fit's,
    no hook is left after the run; the averaging strategy's rounds on the device equal the local SGD step."""
    result = driven("torch", "device_sum")
    assert result["overlapped"]["summed_by"] == ["device-overlapped"] * 2, result["overlapped"]
    assert result["overlapped"]["padded"] == [0, 2]  # worker 1's pad steps: zeros, every bucket at apply
    assert result["at_apply"]["summed_by"] == result["device_average"]["summed_by"] == ["device", "device"]
    assert result["numpy"]["summed_by"] == ["shared", "shared"], result["numpy"]
    assert result["overlapped_vs_at_apply"] <= 1e-6 and result["overlapped_vs_numpy"] <= 1e-6, result
    assert result["notebook_hooks"] == 0
    # Keras' own step in one process (one rank): the hooks saw the very gradients apply got, every step.
    for name, run in result["in_process"].items():
        assert run["refused"] is None and run["hooks"] == 4 and run["steps"] == ROWS // 64, (name, run)
        assert run["early"] == run["steps"] * (run["buckets"] - 1) and run["resummed"] == 0, (name, run)
        assert run["weight_gap"] == 0.0 and run["hooks_left"] == 0, (name, run)
    for case in ("overlapped", "at_apply", "numpy", "device_average"):
        run = result[case]
        assert_same_history(run["history"], run["expected"])
        assert run["weight_gap"] < 1e-5, (case, run["weight_gap"])

@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_what_users_bring_from_other_apis_trains_as_locally(backend, driven):
    """Issue 46. torch: a model of torch.nn modules in keras.layers.TorchModuleWrapper under allreduce equals
    the local fit to 1e-5, history and weights (its workers failed: "No gradients provided for any variable",
    the modules' parameters were not the variables after travel); keras.io's MNIST convnet (on digits) under
    averaging every step with validation_split=0.1 and a short last batch holds the same step to 1e-5.
    JAX: the Keras distribution guide's cell (set_distribution(DataParallel(...))) trains as its local fit,
    saying in one line that nbdist's workers replace the distribution (it was "cannot pickle 'Device'"). Both:
    a model class with its own fit, evaluate and predict."""
    result = driven(backend, "other_apis")
    assert result["backend"] == backend
    # A model class that preprocesses in its own fit, evaluate and predict (keras_hub's do): the notebook runs
    # its fit around the one nbdist takes, the workers Keras' own (they ran the class's on nbdist's batches,
    # which its preprocessing could not take); evaluate and predict run the class's own on the workers.
    own = result["own_methods"]
    assert_same_history(own["history"], own["expected"])
    assert own["weight_gap"] < 1e-5, own["weight_gap"]
    np.testing.assert_allclose(own["evaluate"]["got"], own["evaluate"]["expected"], rtol=1e-5)
    assert own["predict_gap"] < 1e-6, own["predict_gap"]
    cases = ("torch_module", "convnet_averaging") if backend == "torch" else ("keras_distribution",)
    for case in cases:
        run = result[case]
        assert_same_history(run["history"], run["expected"])
        assert run["weight_gap"] < 1e-5, (case, run["weight_gap"])
    if backend == "torch":
        # A torch BatchNorm1d's running statistics (module buffers, no Keras variable) come back to the notebook
        # (they stayed at 0 / 1), averaged over the workers at each epoch's end as Keras' BatchNormalization's
        # are: every worker validated with the statistics the notebook holds, so its evaluate equals the merged
        # val_accuracy; and they are near the local fit's (each worker's from half a batch).
        bn = result["torch_batchnorm"]
        assert bn["moved"] > 0.1, bn
        assert abs(bn["notebook_accuracy"] - bn["val_accuracy"]) < 1e-6, bn
        assert bn["gap_to_local"] < 0.2, bn
        assert bn["batches_tracked"] == 17, bn  # the build call, then 16 steps: validation runs in eval mode
        # A checkpoint keeps them: resumed after epoch 1, the run ends with the uninterrupted run's statistics.
        assert bn["resumed_gap"] < 1e-5 and bn["resumed_batches_tracked"] == 17, bn
    if backend == "jax":
        assert result["keras_distribution"]["notices"] == [
            "the cell's keras.distribution.DataParallel is replaced by nbdist's workers, which each hold the whole "
            "model and train it on their share of the global batch."]


@pytest.mark.timeout(900)
def test_a_dataloader_over_a_lazy_dataset_is_split_by_index_as_one_local_fit(driven):
    """Issue 46 on torch: a cell's model.fit(DataLoader(map-style Dataset, batch_size=64)), its __getitem__
    reading one row at a time, validated on another such loader, under %%dist_train on 2 workers (allreduce)
    equals the cell's local fit to 1e-5, history and weights: each worker reads its part of every batch of
    the loader (it was refused: "cannot be read once"). The trained model's nbdist.evaluate and nbdist.predict
    of such a loader (2 workers, batches of 32 rows and a last of 4, dealt by batch) equal its own
    model.evaluate and model.predict (they were refused); a shuffling loader's predict is refused in one
    sentence (its order is drawn anew at each reading)."""
    result = driven("torch", "lazy_loader")
    assert result["backend"] == "torch"
    assert_same_history(result["history"], result["expected"])
    assert result["weight_gap"] < 1e-5, result["weight_gap"]
    assert result["samples"] == 100 and result["evaluate_gap"] < 1e-5, result
    assert result["predict_gap"] < 1e-6, result
    assert "shuffle=True" in result["shuffled_predict"] and "use shuffle=False" in result["shuffled_predict"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_a_seeded_cell_reproduces_on_jax_and_torch_workers_without_tensorflow(backend, driven):
    """Issue 39: keras.utils.set_random_seed(42) in the cell, no --seed: two runs have identical weights and
    History; unseeded (the cell's own draws fixed) two runs differ; the workers seeded themselves without
    importing TensorFlow (Keras' set_random_seed imports it whenever it is installed). JAX: the first run's
    workers stored their compiled programs under the user's cache, and the cell run again compiled nothing
    new (it loaded them: worker/runtime.py's use_jax_compilation_cache). Then the notebook's
    TensorBoard(update_freq=1): its batch and epoch curves are written (on torch it raised, Keras refusing
    any profile_batch but 0 there)."""
    result = driven(backend, "seeded")
    assert result["backend"] == backend
    seeded, unseeded = result["seeded"], result["unseeded"]
    assert seeded["same_history"] and seeded["weight_gap"] == 0.0, seeded
    assert not unseeded["same_history"] and unseeded["weight_gap"] > 1e-4, unseeded
    assert seeded["workers_tensorflow"] == unseeded["workers_tensorflow"] == [False] * 4
    before, first, again = seeded["cached"]
    if backend == "jax":  # the first run stored programs of its own; the second stored none
        assert set(first) > set(before) and again == first, seeded["cached"]
    else:
        assert before == first == again == [], seeded["cached"]
    tags = result["tensorboard"]
    assert {"batch_loss", "epoch_loss", "epoch_learning_rate"} <= set(tags["train"]), tags
    assert {"epoch_loss", "evaluation_loss_vs_iterations"} <= set(tags["validation"]), tags


@pytest.mark.timeout(900)
def test_two_jax_workers_sum_inside_the_step_as_the_local_fit_and_a_killed_one_fails_the_run(driven):
    """Issue 36, ``--engine jax``: the gradients summed by JAX's own collectives inside the jitted step (Gloo
    on the CPU here, NCCL inside XLA on GPUs: the same code path; jax_engine_driver.py). SGD and Adam equal
    the local fit on the global batch; a BatchNorm and Dropout model equals the same run through the host
    call; uneven shares fall back to the host path in one sentence; the averaging strategy's rounds inside
    the JAX job equal the local step (every step, SGD) and the host's rounds (every 3 steps, uneven shares,
    BatchNorm and Dropout); a SIGKILLed worker fails the run at once (no hang in the collective). JAX's CPU
    collectives have had wrong sums and hangs (DESIGN.md 9)."""
    result = driven("jax", "jax_engine")
    for name in ("sgd", "adam"):
        run = result[name]
        assert run["engines"] == ["jax", "jax"] and run["summed_by"] == ["device", "device"], run
        assert_same_history(run["history"], run["expected"])
        assert run["weight_gap"] < 1e-5, (name, run["weight_gap"])
    # BatchNorm and Dropout: JAX's collective trains what the host call trains (the GPUs' default, issue 36).
    assert result["bn_jax"]["engines"] == ["jax", "jax"] and result["bn_gloo"]["engines"] == ["gloo", "gloo"]
    assert_same_history(result["bn_jax"]["history"], result["bn_gloo"]["history"])
    assert result["bn_gap"] < 1e-6, result["bn_gap"]
    uneven = result["uneven"]  # shares of 188 and 187 rows: the host path, said once
    assert uneven["engines"] == ["gloo", "gloo"], uneven
    assert any(w.startswith("--engine jax needs the same rows per step") for w in uneven["warnings"]), uneven
    assert_same_history(uneven["history"], uneven["expected"])
    assert uneven["weight_gap"] < 1e-5, uneven["weight_gap"]
    # The averaging strategy's rounds on the devices (the GPUs' path, over Gloo here).
    average = result["average"]
    assert average["summed_by"] == ["device", "device"], average
    assert_same_history(average["history"], average["expected"])
    assert average["weight_gap"] < 1e-5, average["weight_gap"]
    uneven = result["average_uneven"]
    assert uneven["True"]["summed_by"] == ["device", "device"] and uneven["False"]["summed_by"] != ["device"] * 2
    assert_same_history(uneven["True"]["history"], uneven["False"]["history"])
    assert result["average_uneven_gap"] < 1e-6, result["average_uneven_gap"]
    dead = result["dead"]
    assert dead["error"] and "worker 1" in dead["error"] and "SIGKILL" in dead["error"], dead
    assert dead["status"] == "failed" and dead["seconds"] < 30, dead


# The gradient sum's path inside a JAX worker's step: an ordered io_callback handed a large array.
HOST_CALLBACK = """
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import io_callback
@jax.jit
def step(x):
    return io_callback(lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(x.shape, x.dtype), x + 1, ordered=True)
x = jnp.ones(1_000_000, jnp.float32)
for _ in range(3):
    x = step(x) * 0.5
print(float(x[0]))
"""


def test_a_jax_worker_on_one_core_takes_large_arrays_into_its_host_callback():
    """JAX's io_callback copies its operands through XLA's CPU client's pool, sized by the cores a process may
    use: on one core that pool's one thread ran the very step calling back, and a worker hung for good (a
    MobileNetV3 on 2 workers of this 2-core machine, 2 runs of 3). A JAX worker's environment gives it two."""
    core = min(os.sched_getaffinity(0))
    try:
        done = subprocess.run([sys.executable, "-c", HOST_CALLBACK], env=worker_env(1, backend="jax"),
                              capture_output=True, text=True, timeout=60,
                              preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    except subprocess.TimeoutExpired:
        pytest.fail("a JAX process on one core hung in its host callback")
    assert done.returncode == 0 and done.stdout.split()[-1] == "4.0", done.stderr[-2000:]
