"""What every job needs on a worker, whatever its kind: its message unpacked, its thread budget."""
from __future__ import annotations

from typing import Any

from ..placement import interop_threads


def pin_threads(threads: int) -> None:
    """Keep N workers on one machine from each using every core."""
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(interop_threads(threads))


def unpack_job(msg: Any) -> dict[str, Any]:
    """Split a job message's arrays into weights, optimizer state, custom objects and data."""
    body, arrays = msg.body, list(msg.arrays)
    take = lambda n: [arrays.pop(0) for _ in range(n)]
    job = dict(body)
    job["weights"] = take(body["n_weights"])
    job["optimizer_weights"] = take(body["n_optimizer"]) if body["n_optimizer"] >= 0 else None
    job["custom_objects"] = take(1)[0].tobytes() if body["has_custom"] else None
    if body.get("fit_layout"):  # an intercepted fit: nested x / y / sample weights (nbdist/fitdata.py)
        from ..fitdata import FitData

        rest = iter(arrays)
        train = FitData.unflatten(body["fit_layout"]["train"], rest)
        job["x"], job["y"], job["sw"] = train.x, train.y, train.sample_weight
        if body["fit_layout"].get("validation"):
            val = FitData.unflatten(body["fit_layout"]["validation"], rest)
            job["xv"], job["yv"], job["swv"] = val.x, val.y, val.sample_weight
        return job
    if body.get("data_source") == "task":  # the Spark task wrote this worker's shard next to it
        from ..wire.shardfile import load_task_data

        job["x"], job["y"] = load_task_data()
    else:
        job["x"], job["y"] = take(1)[0], (take(1)[0] if body["has_y"] else None)
    if body["has_val"]:
        job["xv"], job["yv"] = take(1)[0], (take(1)[0] if body["has_y"] else None)
    return job
