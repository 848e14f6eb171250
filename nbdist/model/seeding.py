"""A run's random seed: the user's ``--seed``, else one drawn from the notebook's own generators.

Keras' documentation tells users to seed in the cell (``keras.utils.set_random_seed(42)``, which seeds
Python's ``random`` and numpy's global generator among others). The run's seed is drawn from those two
generators at the fit: after a seed in the cell the draw is the same every time, so the workers shuffle,
drop out and draw as in the previous run (identical weights and History); the draw advances them, so two
unseeded runs never share a seed. Workers seed Python, numpy and their backend with ``seed + rank``
(``seed_worker``), not with Keras' ``set_random_seed``, which imports TensorFlow whenever it is installed.
"""
from __future__ import annotations

import random

import numpy as np

SEED_BITS = 31


def run_seed(given: int | None) -> int:
    """``given`` (``--seed``), else a seed drawn from the notebook's Python and numpy global generators:
    reproducible when the cell seeded both (as ``keras.utils.set_random_seed`` does), fresh otherwise."""
    if given is not None:
        return int(given)
    mask = 2**SEED_BITS - 1
    python_bits = random.getrandbits(SEED_BITS)
    numpy_bits = int(np.random.randint(0, mask, dtype=np.int64))  # the legacy global RandomState np.random.seed sets
    return (python_bits ^ numpy_bits) & mask


def seed_worker(seed: int, backend: str) -> None:
    """What ``keras.utils.set_random_seed(seed)`` does, without importing TensorFlow off its backend:
    Python, numpy, Keras' global SeedGenerator (remade from Python's ``random`` when next used), and the
    backend's own generator (TensorFlow's op seed, torch's default generator; JAX has none)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    try:
        from keras.src.backend.common import global_state
        from keras.src.random import seed_generator
        from keras.src.utils import rng_utils
    except ImportError:  # another Keras layout: its public call, which may import TensorFlow
        import keras

        keras.utils.set_random_seed(seed)
        return
    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    global_state.set_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR, None)
    if backend == "tensorflow":
        import tensorflow as tf

        tf.random.set_seed(seed)
    elif backend == "torch":
        import torch

        torch.manual_seed(seed)
