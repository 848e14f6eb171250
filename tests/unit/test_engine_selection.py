"""The one engine selector (machine/engines.py) walked over every placement: backend x GPUs x machines x bucket
size x --engine x device_sum, for allreduce and averaging. Each answer is an engine, or one sentence."""
import itertools

import pytest

from nbdist.config import TrainConfig
from nbdist.errors import NbdistError
from nbdist.machine.engines import Choice, Facts, Plan, gpu_facts, select

SMALL, LARGE = 64 * 2**10, 64 * 2**20
BACKENDS = ("tensorflow", "jax", "torch", "numpy-only")  # numpy-only: no torch installed (shared memory alone)


def expected(backend: str, strategy: str, gpus: str, one_host: bool, size: int, engine: str | None,
             device_sum: str) -> str:
    """The engine each placement must get, written as a table of rules (not the selector's code): "shared-small",
    "shared-chunked", "gloo" (host buckets), "gloo-device", "nccl", "jax", or "refused"."""
    torch = backend != "numpy-only"
    keras_backend = "tensorflow" if backend == "numpy-only" else backend
    if engine is not None and not torch:
        return "refused"
    if engine == "jax" and keras_backend != "jax" or engine == "nccl" and keras_backend == "jax":
        return "refused"
    if engine in ("nccl", "jax") and gpus == "shared" or engine == "nccl" and gpus == "none":
        return "refused"
    if engine == "nccl" and device_sum == "never":
        return "refused"
    host = ("shared-small" if size <= 4 * 2**20 else "shared-chunked") if one_host else "gloo"
    if not torch and not one_host:
        host = "refused"
    if keras_backend == "jax":
        psum = engine == "jax" or engine is None and device_sum != "never" and (gpus == "own" or device_sum == "always")
        return "jax" if psum else host
    device = engine == "nccl" or device_sum == "always" or (device_sum == "auto" and engine is None and gpus == "own")
    if not device:
        return host
    if not torch:
        return "refused"
    return "nccl" if gpus == "own" and engine != "gloo" else "gloo-device"


def name(plan: Plan) -> str:
    if plan.engine == "shared":
        return f"shared-{plan.mode}"
    if plan.engine == "torch":
        return plan.mode if plan.tensors == "host" or plan.mode == "nccl" else "gloo-device"
    return plan.engine


def test_the_selector_walks_every_placement():
    walked = 0
    for backend, strategy, gpus, one_host, size, engine, device_sum in itertools.product(
            BACKENDS, ("allreduce", "averaging"), ("none", "own", "shared"), (True, False), (SMALL, LARGE),
            (None, "gloo", "nccl", "jax"), ("auto", "always", "never")):
        if strategy == "averaging" and engine is not None:
            continue  # the config refuses --engine under averaging (test_config_engine_and_strategy)
        facts = Facts("tensorflow" if backend == "numpy-only" else backend, strategy, 2, gpus,
                      "workers 0 and 1 share one GPU" if gpus == "shared" else None, one_host, size, True,
                      has_torch=backend != "numpy-only")
        want = expected(backend, strategy, gpus, one_host, size, engine, device_sum)
        where = (backend, strategy, gpus, one_host, size, engine, device_sum)
        if want == "refused":
            with pytest.raises(NbdistError) as refused:
                select(facts, Choice(engine, device_sum))
            sentence = str(refused.value)
            assert sentence.endswith(".") and "\n" not in sentence and len(sentence) < 260, (where, sentence)
        else:
            plan = select(facts, Choice(engine, device_sum))
            assert name(plan) == want, (where, plan)
            assert plan.overlap == (want in ("nccl", "gloo-device") and backend == "torch" and strategy == "allreduce")
            if want in ("gloo", "shared-small", "shared-chunked") and gpus == "shared":
                assert plan.notice and plan.notice.startswith("Workers 0 and 1 share one GPU"), where
        walked += 1
    assert walked == 4 * 3 * 2 * 2 * (4 * 3 + 3)


def test_one_worker_sums_nothing_and_jax_gives_way_to_the_host_where_rows_differ():
    assert select(Facts("torch", world=1, gpus="own"), Choice("nccl")) == Plan("none")
    unequal = select(Facts("jax", gpus="own", equal_steps=False, bucket_bytes=SMALL))
    assert unequal.summed_by == "shared" and "same rows per step" in unequal.notice
    asked = select(Facts("jax", equal_steps=False, one_host=False), Choice("jax"))
    assert asked.engine_name == "gloo" and asked.notice.startswith("--engine jax needs the same rows per step")
    # Averaging rounds run one program whatever the shares.
    assert select(Facts("jax", "averaging", gpus="own", equal_steps=False)).engine == "jax"


def test_gpu_facts_and_what_reports_name():
    assert gpu_facts([0, 0]) == ("none", None)
    assert gpu_facts([5, 7]) == ("own", None)
    assert gpu_facts([5, 5]) == ("shared", "workers 0 and 1 share one GPU")
    assert gpu_facts([5, 0]) == ("shared", "worker 1 has no GPU")
    plans = {"shared": Plan("shared", "small"), "shared-chunked": Plan("shared", "chunked"),
             "allreduce": Plan("torch", "gloo"), "device": Plan("torch", "nccl", "device"),
             "device-overlapped": Plan("torch", "gloo", "device", True)}
    assert {summed: plan.summed_by for summed, plan in plans.items()} == {s: s for s in plans}
    assert Plan("none").summed_by is None and Plan("jax", tensors="device").summed_by == "device"


@pytest.mark.parametrize("changes,words", [
    ({"engine": "horovod"}, "--engine horovod is gone"),
    ({"engine": "mpi"}, "unknown engine 'mpi'"),
    ({"device_sum": "yes"}, "device_sum must be one of auto, always, never"),
    ({"bucket_bytes": 0}, "bucket_bytes must be a whole number of bytes"),
    ({"overlap": "no"}, "overlap must be True or False"),
    ({"engine": "nccl", "device_sum": "never"}, "drop one of them"),
])
def test_engine_fields_are_checked_at_the_door_in_one_sentence(changes, words):
    with pytest.raises(NbdistError, match=words):
        TrainConfig(**changes)
