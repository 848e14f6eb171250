"""Issue 39: the run's seed is ``--seed`` when given, else drawn from the notebook's Python and numpy global
generators at the fit, so a cell seeded with keras.utils.set_random_seed draws the same seed every run and an
unseeded one a fresh seed each time (the worker side is tests/workers/test_seeded_cell.py)."""
from __future__ import annotations

import random

import keras
import numpy as np

from nbdist.model.seeding import run_seed, seed_worker


def test_a_seeded_notebook_draws_the_same_run_seed_and_an_unseeded_one_a_new_one():
    assert run_seed(7) == 7
    keras.utils.set_random_seed(42)
    first = run_seed(None)
    keras.utils.set_random_seed(42)
    assert run_seed(None) == first
    random.seed(42)
    np.random.seed(42)  # the older recipe, without Keras
    assert run_seed(None) == first
    draws = {run_seed(None) for _ in range(20)}  # the generators move on: a fresh seed each run
    assert len(draws) == 20 and first not in draws and all(0 <= d < 2**31 for d in draws)


def test_a_worker_seeds_as_set_random_seed_does():
    seed_worker(11, keras.backend.backend())
    mine = (random.random(), np.random.rand(), keras.random.uniform(()).numpy().item())
    keras.utils.set_random_seed(11)
    theirs = (random.random(), np.random.rand(), keras.random.uniform(()).numpy().item())
    assert mine == theirs
