"""A worker the kernel's out-of-memory killer ends is named as such, with its peak memory and what to lower."""
from __future__ import annotations

import pytest

import nbdist
from nbdist.errors import TrainingFailed

from ..conftest import mlp
from ..memory_cgroup import join, memory_cgroup


def test_a_worker_killed_by_the_oom_killer_is_named(digits, no_leftover_workers):
    X, y = digits
    model = mlp()
    with memory_cgroup(150 * 2**20) as cgroup:  # less than importing TensorFlow takes
        job = nbdist.train(model, X, y, epochs=1, workers=2, background=True, ui="none")
        join(cgroup, job._handles[1].proc.pid)  # within milliseconds of its start, long before TensorFlow
        with pytest.raises(TrainingFailed) as info:
            job.wait(timeout=300)
    message = str(info.value)
    assert "worker 1" in message and "out-of-memory killer after reaching" in message, message
    assert "--stream-buffer" in message and "\n" not in message
