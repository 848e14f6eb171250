"""Allreduce on CPU cores, torch backend (issue 36's CPU part), measured in one run; prints one table.

The issue's 16-core check (benchmarks/gpu_check/check.py step_cpu_scaling) trains a 256-1024-1024-10 MLP
(1.3M parameters, 5.2 MB of gradients) on generated rows, 64 rows per worker per step, against plain
``model.fit`` on all cores. This script runs the parts of it a small machine can show:

(a) the kernel: one step's gradient exchange of that model between 2 worker processes of this machine
    (``GradientSum.exchange``, the torch/JAX path: scaled, summed through shared memory chunk by chunk,
    copied out, the scale fused into the sum's copy-in), ms per call, pinned and unpinned.
(b) training: plain fit on all cores, 1 worker (all cores), 2 workers (a core each), samples per second
    and each worker's ms per step in compute and in synchronisation (its phase timers); with ``--before
    DIR`` (an nbdist checkout, e.g. ``git archive BASE nbdist | tar -x -C DIR``) the 2 workers also run
    that code, in alternating rounds.

    PYTHONPATH=. python benchmarks/cpu_scaling.py [--part kernel|fit|all] [--repeats 200] [--rows 4096]
        [--fit-repeats 2] [--before DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("KERAS_BACKEND", "torch")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if not os.environ.get("PYTHONPATH"):  # a run of another checkout (--before) sets it
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DIM, HIDDEN, CLASSES, BATCH = 256, (1024, 1024), 10, 64
CORES = sorted(os.sched_getaffinity(0))


def shapes() -> list[tuple[int, ...]]:
    """The MLP's variables, kernels and biases, as Keras orders them."""
    out, prev = [], DIM
    for width in (*HIDDEN, CLASSES):
        out += [(prev, width), (width,)]
        prev = width
    return out


# -- (a) the kernel ---------------------------------------------------------------------------
class _Var:
    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


KERNEL_MODES = [("scale fused into the sum; 1 thread, pinned", 1, True),
                ("scale fused; 1 thread, unpinned", 1, False)]


def _kernel_rank(rank: int, port: int, repeats: int) -> None:
    """Every mode of ``KERNEL_MODES`` in turn, call after call, in the same 2 processes (load hits all alike)."""
    import torch

    from nbdist.machine.engines import Plan
    from nbdist.strategies.collective import GlooCollective
    from nbdist.strategies.gradient_sum import GradientSum

    torch.set_num_threads(1)
    gloo = GlooCollective(rank, 2, "127.0.0.1", port, timeout=120)
    summer = GradientSum(gloo, [_Var(s) for s in shapes()], Plan("shared", "chunked", bucket_bytes=2 * 2**20))
    chunked = summer._shared
    assert chunked is not None, "the workers could not share memory"
    waited = [0.0]
    wait_all = chunked._wait_all

    def timed_wait(k: int) -> None:
        t = time.perf_counter()
        wait_all(k)
        waited[0] += time.perf_counter() - t

    chunked._wait_all = timed_wait  # type: ignore[method-assign]
    rng = np.random.default_rng(rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes()]
    times: dict[str, list[float]] = {m[0]: [] for m in KERNEL_MODES}
    waits: dict[str, list[float]] = {m[0]: [] for m in KERNEL_MODES}
    digests: dict[str, float] = {}
    for i in range(repeats + 5):  # the first five rounds warm up
        for label, _threads, pinned in KERNEL_MODES:
            os.sched_setaffinity(0, {CORES[rank % len(CORES)]} if pinned else set(CORES))
            summer.weight, summer.total = 64.0, 128.0
            gloo.allreduce_sum(np.zeros(1, np.float32))  # both start together
            waited[0] = 0.0
            t0 = time.perf_counter()
            out = summer.exchange(*grads)
            dt = time.perf_counter() - t0
            if i >= 5:
                times[label].append(dt)
                waits[label].append(waited[0])
            digests[label] = float(sum(float(np.sum(o, dtype=np.float64)) for o in out))
    summer.close()
    gloo.close()
    print(json.dumps({label: {"ms": statistics.median(times[label]) * 1e3,
                              "wait_ms": statistics.median(waits[label]) * 1e3, "digest": digests[label]}
                      for label in times}), flush=True)


def _port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def kernel(repeats: int) -> dict[str, dict[str, Any]]:
    """Per mode: median ms per exchange of the slower rank, its wait for the peer, whether all sums agree."""
    port = _port()
    procs = [subprocess.Popen([sys.executable, __file__, "--kernel-rank", str(r), "--port", str(port),
                               "--repeats", str(repeats)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [json.loads(p.communicate(timeout=900)[0].strip().splitlines()[-1]) for p in procs]
    digests = {o[label]["digest"] for o in outs for label in o}
    return {label: {"ms": max(o[label]["ms"] for o in outs), "wait_ms": min(o[label]["wait_ms"] for o in outs),
                    "same": len(digests) == 1} for label in outs[0]}


def passes_in_one_process(repeats: int = 200) -> dict[str, float]:
    """ms of each pass over the 5.2 MB of gradients, one thread, in cache: the unit of the table."""
    n = sum(int(np.prod(s)) for s in shapes())
    g = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    a, b = np.empty_like(g), np.empty_like(g)
    f = np.float32(0.5)

    def med(fn: Any) -> float:
        fn()
        ts = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e3

    return {"scale_copy": med(lambda: np.multiply(g, f, out=a)), "copy": med(lambda: np.copyto(b, a)),
            "add_2_rows": med(lambda: np.add(g, a, out=b))}


def generated(rows: int, seed: int = 3) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, DIM), dtype=np.float32)
    w = rng.standard_normal((DIM, CLASSES)).astype(np.float32)
    return x, np.argmax(x @ w, axis=1).astype(np.int32)


def mlp() -> Any:
    import keras

    layers: list[Any] = [keras.Input((DIM,))]
    for i, width in enumerate(HIDDEN):
        layers.append(keras.layers.Dense(width, activation="relu",
                                         kernel_initializer=keras.initializers.GlorotUniform(seed=4 + i)))
    layers.append(keras.layers.Dense(CLASSES, activation="softmax",
                                     kernel_initializer=keras.initializers.GlorotUniform(seed=104)))
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(1e-3), "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def plain_fit(x: np.ndarray, y: np.ndarray, epochs: int, threads: int = len(CORES)) -> dict[str, float]:
    import keras
    import torch

    torch.set_num_threads(threads)
    ends: list[float] = []

    class Ends(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            ends.append(time.perf_counter())

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            ends[-1] = time.perf_counter() - ends[-1]

    mlp().fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[Ends()])
    torch.set_num_threads(1)  # the workers get the cores
    epoch = statistics.median(ends[1:])
    return {"samples_per_s": len(x) / epoch, "step_ms": epoch / -(-len(x) // BATCH) * 1e3}


def nbdist_fit(x: np.ndarray, y: np.ndarray, epochs: int, workers: int) -> dict[str, Any]:
    import nbdist

    job = nbdist.train(mlp(), x, y, epochs=epochs, batch_size=BATCH, workers=workers, strategy="allreduce",
                       backend="local", shuffle=False, lr_scaling="none", phase_times=True)
    epoch = statistics.median(job.state.epoch_seconds[1:])
    steps = -(-len(x) // (BATCH * workers))
    out: dict[str, Any] = {"samples_per_s": len(x) / epoch, "summed_by": job.reports[0].get("summed_by")}
    per = [job.reports[r].get("phase_times") or [] for r in range(workers)]
    if all(per):
        out["compute_ms"] = max(statistics.median(e["steps"] for e in p[1:]) for p in per) / steps * 1e3
        out["sync_ms"] = max(statistics.median(e["sync"] for e in p[1:]) for p in per) / steps * 1e3
    return out


def _fit_run(kind: str, rows: int, epochs: int) -> dict[str, Any]:
    x, y = generated(rows)
    if kind.startswith("plain"):
        return plain_fit(x, y, epochs, int(kind[5:] or len(CORES)))
    return nbdist_fit(x, y, epochs, int(kind[1:]))


def fit_once(kind: str, rows: int, epochs: int, code: str | None) -> dict[str, Any]:
    """One run (``plain``, ``plain1`` on one thread, ``w1``, ``w2``) in a process of its own, with nbdist from
    ``code`` (a checkout) or this one; the workers inherit it (PYTHONPATH, and the directory: ``python -m``
    puts it first on the path)."""
    root = code or str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "KERAS_BACKEND": "torch", "TF_CPP_MIN_LOG_LEVEL": "3"}
    run = subprocess.run([sys.executable, __file__, "--fit-run", kind, "--rows", str(rows), "--epochs", str(epochs)],
                         env=env, cwd=root, capture_output=True, text=True, timeout=900, check=True)
    return json.loads(run.stdout.strip().splitlines()[-1])


def fit_part(rows: int, epochs: int, repeats: int, before: str | None) -> list[tuple[str, dict[str, Any]]]:
    """Alternating rounds (so load from other programs hits every row alike); medians over the rounds."""
    runs = [(f"plain fit, {len(CORES)} threads", "plain", None), ("plain fit, 1 thread", "plain1", None),
            (f"1 worker, {len(CORES)} threads", "w1", None)]
    if before:
        runs.append(("2 workers, 1 thread each, before", "w2", before))
    runs.append(("2 workers, 1 thread each" + (", after" if before else ""), "w2", None))
    got: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in runs}
    for _ in range(repeats):
        for label, kind, code in runs:
            got[label].append(fit_once(kind, rows, epochs, code))
    out = []
    for label, results in got.items():
        keys = [k for k, v in results[0].items() if isinstance(v, float)]
        out.append((label, {**results[0], **{k: statistics.median(r[k] for r in results) for k in keys}}))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("kernel", "fit", "all"), default="all")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--fit-repeats", type=int, default=2)
    p.add_argument("--before", default=None, help="another nbdist checkout to compare with, e.g. the base commit "
                   "unpacked by git archive")
    p.add_argument("--fit-run", default=None, help=argparse.SUPPRESS)
    p.add_argument("--kernel-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.fit_run is not None:
        print(json.dumps(_fit_run(args.fit_run, args.rows, args.epochs)), flush=True)
        return 0
    if args.kernel_rank is not None:
        _kernel_rank(args.kernel_rank, args.port, args.repeats)
        return 0
    print(f"{len(CORES)} cores, load average {os.getloadavg()[0]:.1f}; MLP {DIM}-{'-'.join(map(str, HIDDEN))}-"
          f"{CLASSES}, {sum(int(np.prod(s)) for s in shapes()) * 4 / 1e6:.1f} MB of gradients")
    if args.part in ("kernel", "all"):
        one = passes_in_one_process()
        print("one pass over the gradients, 1 thread: " + ", ".join(f"{k} {v:.3f} ms" for k, v in one.items()))
        res = list(kernel(args.repeats).items())
        base = res[0][1]["ms"]
        print(f"\n(a) one step's exchange, 2 workers, {sum(int(np.prod(s)) for s in shapes()) * 4 / 1e6:.1f} MB, "
              f"medians of {args.repeats} alternating rounds")
        print(f"{'':<48}{'ms/call':>9}{'waited':>9}{'ratio':>7}  same sums")
        for label, r in res:
            print(f"{label:<48}{r['ms']:>9.3f}{r['wait_ms']:>9.3f}{r['ms'] / base:>7.2f}  {r['same']}")
    if args.part in ("fit", "all"):
        rows = fit_part(args.rows, args.epochs, args.fit_repeats, args.before)
        plain = rows[0][1]["samples_per_s"]
        print(f"\n(b) training, {args.rows} rows, {BATCH} rows per worker per step, torch backend, medians of "
              f"{args.fit_repeats} rounds; load average now {os.getloadavg()[0]:.1f}")
        print(f"{'':<34}{'samples/s':>10}{'/plain':>8}{'compute ms':>12}{'sync ms':>9}  summed by")
        for label, r in rows:
            print(f"{label:<34}{r['samples_per_s']:>10.0f}{r['samples_per_s'] / plain:>8.2f}"
                  f"{r.get('compute_ms', r.get('step_ms', float('nan'))):>12.2f}{r.get('sync_ms', 0.0):>9.2f}"
                  f"  {r.get('summed_by') or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
