"""Summing 100 MiB of float32 between 2 processes of this machine: nbdist's shared memory against raw Gloo.

Both contestants run in the same 2 processes (pinned one core each, as local workers are), in
alternation, so load from other programs hits both alike. Gloo: ``torch.distributed.all_reduce``
of the bucket over loopback TCP (P4's anchor). nbdist: ``SharedChunkedSum`` (strategies/shared.py)
reading the arrays where they are and writing the summed bucket, as the allreduce strategy calls it
with TensorFlow's gradients. Prints per-call medians (the slower rank's) and their ratio.

    PYTHONPATH=. python benchmarks/shared_sum.py [--mib 100] [--repeats 10] [--chunk FLOATS]

NBDIST_BENCH_VERBOSE=1 also prints every call's time and how long each rank waited for the other.
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

import numpy as np


def _rank(rank: int, port: int, mib: int, repeats: int, chunk: int) -> None:
    import torch
    import torch.distributed as dist

    from nbdist.strategies.collective import GlooCollective
    from nbdist.strategies.shared import open_chunked_sum

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        os.sched_setaffinity(0, {cores[rank]})
    torch.set_num_threads(1)
    gloo = GlooCollective(rank, 2, "127.0.0.1", port, timeout=120)
    n = mib * 2**20 // 4
    grads = np.random.default_rng(rank).standard_normal(n).astype(np.float32)
    out = np.zeros(n, dtype=np.float32)
    summer = open_chunked_sum(gloo, n, chunk)
    assert summer is not None, "the workers could not share memory"
    plan = summer.plan([0], [n], n)
    if "NBDIST_BENCH_YIELD_AFTER" in os.environ:  # A/B of the spin policy
        summer.yield_after = int(os.environ["NBDIST_BENCH_YIELD_AFTER"])
    waited = [0.0]
    if os.environ.get("NBDIST_BENCH_VERBOSE"):  # time the waits for the peer, apart from the work
        wait_all = summer._wait_all

        def timed_wait(k: int) -> None:
            t = time.perf_counter()
            wait_all(k)
            waited[0] += time.perf_counter() - t

        summer._wait_all = timed_wait  # type: ignore[method-assign]
    bucket = grads.copy()
    gloo_times, shm_times = [], []
    for i in range(repeats + 1):  # the first of each is a warm-up
        bucket[:] = grads
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(torch.from_numpy(bucket))
        t1 = time.perf_counter()
        dist.barrier()
        t2 = time.perf_counter()
        summer.sum_into([grads], out, plan)
        t3 = time.perf_counter()
        if i:
            gloo_times.append(t1 - t0)
            shm_times.append(t3 - t2)
    same = bool(np.array_equal(out, bucket))  # Gloo's 2-rank sum adds the same two floats
    summer.close()
    gloo.close()
    if os.environ.get("NBDIST_BENCH_VERBOSE"):
        print(rank, [round(t * 1e3) for t in gloo_times], [round(t * 1e3) for t in shm_times],
              f"waited {waited[0] * 1e3 / (repeats + 1):.0f} ms per sum", file=sys.stderr)
    print(json.dumps({"gloo": gloo_times, "shm": shm_times, "same_as_gloo": same}), flush=True)


def measure(mib: int = 100, repeats: int = 10, chunk: int | None = None) -> dict[str, float]:
    """Median seconds per sum (the slower rank's) for Gloo and for shared memory, and their ratio."""
    from nbdist.strategies.shared import CHUNK_ELEMENTS

    chunk = chunk or CHUNK_ELEMENTS
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port), "--mib", str(mib),
                               "--repeats", str(repeats), "--chunk", str(chunk)], stdout=subprocess.PIPE, text=True)
             for r in range(2)]
    outs = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    gloo = max(statistics.median(o["gloo"]) for o in outs)
    shm = max(statistics.median(o["shm"]) for o in outs)
    return {"gloo": gloo, "shm": shm, "ratio": shm / gloo, "same_as_gloo": all(o["same_as_gloo"] for o in outs)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--mib", type=int, default=100)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--chunk", type=int, default=None, help="floats per row of the segment (default: nbdist's)")
    args = p.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.port, args.mib, args.repeats, args.chunk)
        return
    from nbdist.strategies.shared import CHUNK_ELEMENTS

    chunk = args.chunk or CHUNK_ELEMENTS
    r = measure(args.mib, args.repeats, chunk)
    print(f"{args.mib} MiB, 2 processes, chunk {chunk * 4 // 1024} KiB; load average {os.getloadavg()[0]:.1f}: "
          f"Gloo {r['gloo'] * 1e3:.1f} ms, shared memory {r['shm'] * 1e3:.1f} ms, ratio {r['ratio']:.2f}, "
          f"bits equal to Gloo's: {r['same_as_gloo']}")


if __name__ == "__main__":
    main()
