"""A Gloo sum waited for in slices (``GlooCollective._wait`` in an elastic run, which looks for the driver's
``GenerationBroken`` between them) against torch's plain blocking call, in the same 2 processes, alternating.

Prints the medians per call for a small bucket (16 floats: a step's row counts, a join flag) and a
100,000-float one, and their ratio (sliced / plain; 1.0: no cost).

    PYTHONPATH=. python benchmarks/gloo_wait.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time


def _rank(rank: int, port_queue, results, rounds: int) -> None:
    import numpy as np
    import torch

    from nbdist.strategies.collective import GlooCollective, open_store_listener

    fd = None
    if rank == 0:
        fd, port = open_store_listener("127.0.0.1")
        port_queue.put(port)
    else:
        port = port_queue.get(timeout=60)
    coll = GlooCollective(rank, 2, "127.0.0.1", port, 60.0, listen_fd=fd)
    coll.broken = lambda: None  # as in an elastic run: allreduce_sum waits in slices
    times: dict[tuple[int, str], list[float]] = {}
    for size, calls in ((16, 500), (100_000, 100)):
        buf = np.ones(size, dtype=np.float32)
        for _ in range(rounds):
            for mode in ("plain", "sliced"):
                coll.allreduce_sum(buf)  # both ranks in step before each timed block
                start = time.perf_counter()
                for _ in range(calls):
                    if mode == "plain":
                        coll._dist.all_reduce(torch.from_numpy(buf))
                    else:
                        coll.allreduce_sum(buf)
                times.setdefault((size, mode), []).append((time.perf_counter() - start) / calls)
    coll.close()
    results.put((rank, times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    ports, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, ports, results, args.rounds)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(30)
    for size in (16, 100_000):
        plain, sliced = (statistics.median(got[0][(size, m)]) * 1e6 for m in ("plain", "sliced"))
        print(f"{size:>7} floats: plain {plain:8.1f} us, sliced {sliced:8.1f} us, sliced / plain {sliced / plain:.2f}")


if __name__ == "__main__":
    main()
