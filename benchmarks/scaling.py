"""Allreduce scaling, measured in one run; prints a table of ratios.

1. Throughput of 2 workers / 1 worker (weak scaling: each worker trains the same number of
   samples of a compute-bound CNN, one thread each; the 1-worker run is pinned to one core).
   Both workers run on this machine, so the CNN's 117 KiB of gradients are summed through
   shared memory (strategies/shared.py).
   Goal >= 1.8.
2. Synchronisation of 100 MB of gradients per step: nbdist's time inside the gradient
   allreduce (Gloo's allreduce of the gradient bucket, weighted through the loss,
   from TensorFlow's memory into the bucket; the averages go back to TensorFlow as aligned
   views, without a copy) / a raw torch.distributed Gloo allreduce of the same bytes between
   2 processes, in one call. Goal <= 1.10.

Run: PYTHONPATH=. python benchmarks/scaling.py   (about 2-4 minutes on 2 idle cores)
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time

import numpy as np

GRAD_BYTES = 100 * 2**20
# Taken once: a run narrowed to one core must not leave the next run only that core to choose from.
CORES = sorted(os.sched_getaffinity(0))


def _set_cores(cores: int) -> None:
    os.sched_setaffinity(0, set(CORES[:cores]))


def cnn_throughput(workers: int, per_worker: int = 1024, epochs: int = 5) -> float:
    """Samples per second over the last epochs (the first traces the step and is excluded)."""
    import keras


    rng = np.random.default_rng(0)
    x = rng.random((per_worker * workers, 32, 32, 3), dtype=np.float32)
    y = rng.integers(0, 10, len(x))
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Conv2D(32, 3, activation="relu"),
                              keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
                              keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
                              keras.layers.Dense(10, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy")
    stamps: list[float] = []

    def on_event(kind: str, state, payload) -> None:
        if kind == "epoch":
            stamps.append(time.perf_counter())

    from nbdist.api import prepare
    from nbdist.config import TrainConfig

    _set_cores(workers)  # workers inherit the affinity: one core, hence one thread, per worker
    cfg = TrainConfig(epochs=epochs, batch_size=32, workers=workers, strategy="allreduce", ui="none")
    job = prepare(model, cfg, x, y, None, listeners=[on_event])
    job.start()
    job.wait()
    return len(x) * (epochs - 1) / (stamps[-1] - stamps[0])


def nbdist_sync_per_step(steps: int = 12, mib: int = 100, shared_memory: bool = False) -> float:
    """Seconds per step inside nbdist's gradient allreduce for a model with ~``mib`` MiB of weights.

    Each worker times its own allreduce steps; the one that waited least for its peer's
    compute is the closer measure of synchronisation itself, so the minimum over workers.
    ``shared_memory``: the two local workers sum through shared memory (nbdist's default on one
    machine); False: through Gloo's allreduce, the path between machines.
    """
    import keras

    import nbdist

    width = int((mib * 2**20 / 4) ** 0.5)  # 5120 * 5120 float32 = 100 MiB in one Dense kernel
    x = np.random.default_rng(1).random((2 * steps, width), dtype=np.float32)
    y = np.zeros((len(x), 1), dtype=np.float32)
    model = keras.Sequential([keras.Input((width,)), keras.layers.Dense(width, use_bias=False),
                              keras.layers.Dense(1, use_bias=False)])
    model.compile(keras.optimizers.SGD(1e-6), "mse")
    job = nbdist.train(model, x, y, epochs=1, batch_size=1, workers=2, strategy="allreduce", shuffle=False,
                       shared_memory=shared_memory)
    return min(w.sync_seconds for w in job.state.workers) / steps


def raw_gloo_allreduce(repeats: int = 12, mib: int = 100) -> float:
    """Median seconds of one Gloo allreduce of ``mib`` MiB between 2 fresh processes."""
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [subprocess.Popen([sys.executable, __file__, "--raw-rank", str(r), "--port", str(port),
                               "--repeats", str(repeats), "--mib", str(mib)],
                              stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    return max(float(o.strip().splitlines()[-1]) for o in outs)


def _raw_rank(rank: int, port: int, repeats: int, mib: int = 100) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    width = int((mib * 2**20 / 4) ** 0.5)
    # The same bytes as nbdist's bucket in nbdist_sync_per_step: both kernels and the sample count.
    buf = torch.ones(width * width + width + 1, dtype=torch.float32)
    dist.all_reduce(buf)  # warm up the connections
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    dist.destroy_process_group()
    print(float(np.median(times)))


def bus_bandwidth(seconds: float, ranks: int = 2, nbytes: int = GRAD_BYTES) -> float:
    """Allreduce bus bandwidth in GB/s (the NCCL-tests convention: 2(n-1)/n bytes per rank)."""
    return 2 * (ranks - 1) / ranks * nbytes / seconds / 1e9


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--raw-rank", type=int, default=None)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--repeats", type=int, default=12)
    p.add_argument("--mib", type=int, default=100)
    args = p.parse_args()
    if args.raw_rank is not None:
        _raw_rank(args.raw_rank, args.port, args.repeats, args.mib)
        return
    logging.basicConfig(level=logging.WARNING)
    cores = len(CORES)
    if cores < 2:
        sys.exit("this benchmark needs 2 cores")
    one = cnn_throughput(1)
    two = cnn_throughput(2)
    _set_cores(cores)
    raw = raw_gloo_allreduce()
    ours = nbdist_sync_per_step()
    shm = nbdist_sync_per_step(shared_memory=True)
    rows = [
        ("CNN throughput, 1 worker (samples/s)", f"{one:.1f}", ""),
        ("CNN throughput, 2 workers (samples/s)", f"{two:.1f}", ""),
        ("  2 workers / 1 worker", f"{two / one:.2f}", "goal >= 1.8"),
        ("raw Gloo allreduce, 100 MiB (ms)", f"{raw * 1e3:.1f}", f"bus {bus_bandwidth(raw):.2f} GB/s"),
        ("nbdist sync per step, 100 MiB (ms)", f"{ours * 1e3:.1f}", f"bus {bus_bandwidth(ours):.2f} GB/s"),
        ("  nbdist / raw Gloo", f"{ours / raw:.2f}", "goal <= 1.10"),
        ("nbdist sync per step, shared memory (ms)", f"{shm * 1e3:.1f}", f"bus {bus_bandwidth(shm):.2f} GB/s"),
        ("  shared memory / raw Gloo", f"{shm / raw:.2f}", "goal <= 0.7 (P4M)"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {cores} cores")
    for name, value, note in rows:
        print(f"{name:<{width}}  {value:>9}  {note}")


if __name__ == "__main__":
    main()
