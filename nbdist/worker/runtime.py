"""What every job needs on a worker, whatever its kind: its message decoded, its thread budget."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from ..machine.keras_backend import configured_backend, optional_packages_hidden
from ..machine.placement import interop_threads
from ..model.tensors import keras_data
from ..wire.messages import DATA_FIELDS, JobMessage

log = logging.getLogger(__name__)


def import_keras() -> None:
    """Import Keras and its backend (TensorFlow's whole API for its own) without the packages they would
    load for nothing (keras_backend.OPTIONAL_AT_IMPORT); a no-op once __main__ has imported them so."""
    backend = configured_backend()
    with optional_packages_hidden(backend):
        import keras  # noqa: F401

        if backend == "tensorflow":
            import tensorflow  # noqa: F401
    if backend == "jax":
        use_jax_compilation_cache()


JAX_CACHE_BYTES = 512 * 2**20  # JAX evicts the least recently used entries beyond this


def jax_cache_dir() -> Path:
    """Where JAX workers keep their compiled programs: nbdist/jax under the user's cache directory."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nbdist" / "jax"


def use_jax_compilation_cache() -> None:
    """JAX workers load their compiled steps from JAX's persistent compilation cache in ``jax_cache_dir``:
    a cell run again (or another cell with the same model, shapes and devices) loads the train, evaluation
    and prediction steps its workers compiled before instead of compiling them again. JAX keys each entry
    by the program, the devices, its flags and versions, so a change compiles anew. A cache directory the
    user gave JAX (JAX_COMPILATION_CACHE_DIR) is kept; one that cannot be created leaves JAX as it was."""
    import jax

    if jax.config.jax_compilation_cache_dir:
        return
    try:  # no home (some executors), a read-only one, or a JAX without one of these options: JAX as it was
        directory = jax_cache_dir()
        directory.mkdir(parents=True, exist_ok=True)
        settings = {"jax_compilation_cache_max_size": JAX_CACHE_BYTES,
                    # Every program, not only those over JAX's default second: a worker's evaluation and
                    # prediction steps compile in well under one, and reading an entry back costs less.
                    "jax_persistent_cache_min_compile_time_secs": 0.0}
        for name in settings:
            getattr(jax.config, name)  # all known before any is set
    except (OSError, RuntimeError, AttributeError) as exc:
        log.info("no JAX compilation cache: %s", exc)
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))
    for name, value in settings.items():
        jax.config.update(name, value)


def pin_threads(threads: int) -> None:
    """Keep N workers on one machine from each using every core (OMP_NUM_THREADS in the worker's
    environment does it for JAX's and torch's CPU kernels as they load); on torch, set here too, so the
    budget holds whatever a warm worker's imports read."""
    import keras

    if keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(threads)
        return
    if keras.backend.backend() != "tensorflow":
        return
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(interop_threads(threads))


def unpack_job(job: JobMessage) -> JobMessage:
    """The job message (decoded by the link, wire/messages.py), with the shard its Spark task wrote, if any,
    and its data as Keras takes it (``keras_data``), this worker's threads pinned first (TensorFlow takes
    them only before its first tensor)."""
    pin_threads(job.threads)
    # The Spark task wrote this worker's shard next to it: training streams it (datasets.job_inputs),
    # evaluation and prediction read it whole.
    if job.data_source == "task" and job.kind != "train":
        from ..wire.shardfile import load_task_data

        job.x, job.y, *weights = load_task_data()  # (x, y, w) with a DataFrame's weight column
        job.sample_weight = weights[0] if weights else None
    if job.data_file is not None and "leaves" in job.data_file:  # memory-mapped inputs of several
        from ..data.structures import fill_leaves
        from ..wire.shardfile import read_rows

        job.x = fill_leaves(job.x, {int(i): read_rows(where) for i, where in job.data_file["leaves"].items()})
    for name in DATA_FIELDS:  # ragged rows as the tf.RaggedTensor they were (data/ragged.py)
        setattr(job, name, keras_data(getattr(job, name)))
    return job
