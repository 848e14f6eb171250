"""An elastic run's commits (worker/elastic.py): when a step commits, and the last two commits held."""
from __future__ import annotations

import numpy as np
import pytest

from nbdist.worker.elastic import Commit, commit_steps


def test_a_commit_every_k_steps_falls_on_multiples_of_k_before_the_epoch_ends() -> None:
    assert [d for d in range(1, 20) if commit_steps(d, 4, 19)] == [4, 8, 12, 16]
    assert [d for d in range(1, 9) if commit_steps(d, 4, 8)] == [4]  # the epoch's last step: the next start commits
    assert not any(commit_steps(d, None, 19) for d in range(1, 20))


def test_a_worker_holds_its_last_two_commits_and_rolls_back_to_either() -> None:
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(0.1), "mse")
    commit = Commit()
    kernel = model.layers[0].kernel
    for step, value in ((0, 1.0), (4, 2.0), (8, 3.0)):
        kernel.assign(np.full((3, 2), value, "float32"))
        commit.take(model, 1, step)
    assert [(s.epoch, s.step) for s in commit.held] == [(1, 4), (1, 8)]
    assert commit.put(model, 1, 4).step == 4 and float(kernel.numpy()[0, 0]) == 2.0
    assert commit.put(model, 1, 8).step == 8 and float(kernel.numpy()[0, 0]) == 3.0
    with pytest.raises(RuntimeError, match=r"resumes at \(epoch, step\) \(1, 0\)"):
        commit.put(model, 1, 0)
