"""Faults named as such: a worker the out-of-memory killer ends (its peak memory, what to lower), a full disk."""
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
        # Cold workers (warm_workers=False): a worker's TensorFlow import is charged to the cap.
        job = nbdist.train(model, X, y, epochs=1, workers=2, background=True, ui="none", warm_workers=False)
        join(cgroup, job._handles[1].proc.pid)  # within milliseconds of its start, long before TensorFlow
        with pytest.raises(TrainingFailed) as info:
            job.wait(timeout=300)
    message = str(info.value)
    assert "worker 1" in message and "out-of-memory killer after reaching" in message, message
    assert "--stream-buffer" in message and "\n" not in message


def test_a_full_local_directory_is_named(tmp_path):
    """A Spark task writing its partition to a full disk (a 1 MB tmpfs) says which directory and what to do."""
    import subprocess

    import numpy as np

    from nbdist.wire.shardfile import DiskFull, ShardWriter

    full = tmp_path / "full"
    full.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(full)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        writer = ShardWriter(str(full), labels=True)
        with pytest.raises(DiskFull) as info:
            for _ in range(10):
                writer.append(np.zeros((4096, 64), np.float32), np.zeros(4096, np.int64))
            writer.close()
    finally:
        subprocess.run(["umount", "-l", str(full)], check=False)
    assert f"local directory {full} is full" in str(info.value) and "spark.local.dir" in str(info.value)
