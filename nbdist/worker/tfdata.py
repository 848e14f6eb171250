"""What every worker's tf.data pipeline is set up with (datasets.py, streams.py, pydatasets.py)."""
from __future__ import annotations

from typing import Any


def without_autotune(dataset: Any) -> Any:
    """``dataset`` with tf.data's autotuning off: its fixed prefetch is all a worker needs.

    Why: an autotuned iterator runs a model thread that sleeps between optimisations, the sleep
    doubling up to a minute, and deleting the iterator waits for that thread to wake. Measured
    here: a worker's ``fit`` returned 20-45 s after its last epoch on a 25M-parameter model (3-5
    epochs of ~8 s), stuck in the iterator's destructor; without autotuning it returns at once.
    """
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)
