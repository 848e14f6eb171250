"""The driver's Run base (nbdist/driver/run.py) and the jobs on it, read without starting anything."""
from __future__ import annotations

import ast
import inspect

import pytest

from nbdist.driver import inference, run, training


def _assigned_attributes(cls: type, only_init: bool) -> dict[str, int]:
    """``self.NAME = ...`` targets in ``cls``'s own methods (or only its ``__init__``): name -> line."""
    tree = ast.parse(inspect.getsource(cls))
    found: dict[str, int] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef) or (only_init and fn.name != "__init__"):
            continue
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        found.setdefault(t.attr, node.lineno)
    return found


JOBS = [training.TrainingJob, inference.EvaluationJob, inference.PredictionJob]


@pytest.mark.parametrize("job", JOBS, ids=lambda c: c.__name__)
def test_every_attribute_is_made_in_init(job: type) -> None:
    made = set()
    for cls in job.__mro__:
        if cls.__module__.startswith("nbdist."):
            made |= set(_assigned_attributes(cls, only_init=True))
    late = {name: (cls.__name__, line) for cls in job.__mro__ if cls.__module__.startswith("nbdist.")
            for name, line in _assigned_attributes(cls, only_init=False).items() if name not in made}
    assert not late, f"attributes first made outside __init__: {late}"


def test_inference_jobs_do_not_inherit_training_machinery() -> None:
    for job in (inference.EvaluationJob, inference.PredictionJob):
        assert issubclass(job, run.Run) and not issubclass(job, training.TrainingJob)
        for name in ("_restart", "_save_checkpoint", "_apply_last_weights", "weights_epoch"):
            assert not hasattr(job, name), name


def test_the_run_base_implements_the_public_job_api() -> None:
    for name in ("status", "history", "error", "start", "wait", "stop", "run_in_background", "worker_log", "pump"):
        assert name in vars(run.Run), name


def test_a_lost_spark_task_is_looked_at_before_the_peers_cancelled_with_it() -> None:
    """Spark aborts a barrier stage when one task dies and cancels the others: every worker then ends with code
    1 at once, and the one Spark named (lost) is the cause to report, whatever its rank."""
    from types import SimpleNamespace

    from nbdist.driver.failures import likely_causes_first

    def worker(rank, code, lost=False):
        return SimpleNamespace(rank=rank, lost=lost, exit_status=lambda: code)

    cancelled, lost = worker(0, 1), worker(1, 1, lost=True)
    assert [h.rank for h in likely_causes_first([cancelled, lost])] == [1, 0]
    raised, killed, running = worker(0, 1), worker(1, -9), worker(2, None)
    assert [h.rank for h in likely_causes_first([raised, killed, running])] == [1, 0, 2]
    assert [h.rank for h in likely_causes_first([worker(0, None), worker(1, None)])] == [0, 1]
