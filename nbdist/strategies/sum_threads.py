"""The chunked shared-memory sum's passes split over a worker's threads (its thread budget).

While a worker synchronises, the cores of its thread budget wait: on Keras' torch backend its intra-op
threads idle until the summed gradients are back. Each phase of ``SharedChunkedSum`` (shared.py) copies
a chunk in, adds this worker's slice of another and copies a summed one out: element by element, so each
pass can be cut into consecutive ranges and run by several threads at once (numpy releases the GIL for
large copies and ufuncs). Every element sees the same additions in the same order whatever the cut: the
sums keep their bits for any number of threads.

A pass is cut only into ranges of at least ``MIN_SPLIT`` elements: waking a thread costs tens of
microseconds, a 256 KiB copy about ten. Opt-in for now (``NBDIST_SUM_THREADS``: a number of threads, or
``budget`` for the worker's thread budget): on this 2-core machine, loaded by other programs, 2 threads
made a phase slower (one process: 99 -> 118-149 us per 2 MiB chunk), and on many cores the helpers would
wake beside the model's OpenMP threads, which spin for a while after each parallel region. To be
measured on many idle cores (benchmarks/gpu_check step cpu_scaling, with and without the variable).
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence

from .ring import ALIGN, block_bounds

ENV_SUM_THREADS = "NBDIST_SUM_THREADS"
MIN_SPLIT = 2**16  # float32 elements (256 KiB) per thread at least
Pieces = list[tuple[int, int, int, int]]  # (array, from, to, bucket position), ring.pieces
Pass = tuple[int, int, Callable[[int, int], None]]  # (lo, hi, fn): fn(a, b) does range(a, b) of the pass


def sum_threads(budget: int, environ: Mapping[str, str] | None = None) -> int:
    """Threads for the sum's passes: ``NBDIST_SUM_THREADS`` (a number, or ``budget``: the worker's), else 1."""
    value = (os.environ if environ is None else environ).get(ENV_SUM_THREADS, "").strip().lower()
    return max(1, int(budget) if value == "budget" else int(value) if value.isdigit() else 1)


def split(lo: int, hi: int, threads: int, minimum: int = MIN_SPLIT, align: int = ALIGN) -> list[tuple[int, int]]:
    """``range(lo, hi)`` cut into at most ``threads`` consecutive ranges of at least ``minimum`` elements
    (the last may be shorter), cut at multiples of ``align`` from ``lo``; one range when it is too short."""
    parts = max(1, min(threads, (hi - lo) // max(1, minimum)))
    return [(lo + a, lo + b) for a, b in block_bounds(hi - lo, parts, align) if a < b] or [(lo, hi)]


def clip(parts: Pieces, lo: int, hi: int) -> Pieces:
    """The pieces' parts that land in bucket positions ``range(lo, hi)``."""
    out = []
    for k, a, b, pos in parts:
        s, e = max(lo, pos), min(hi, pos + b - a)
        if s < e:
            out.append((k, a + s - pos, a + e - pos, s))
    return out


class PhaseThreads:
    """``threads - 1`` helper threads that run a phase's passes with the caller, each its own ranges."""

    def __init__(self, threads: int, timeout: float) -> None:
        self.threads, self.timeout = threads, timeout
        self.minimum = MIN_SPLIT  # elements per thread at least (tests make it small)
        self._job: Callable[[int], None] | None = None
        self._go = [threading.Event() for _ in range(threads - 1)]
        self._done = [threading.Event() for _ in range(threads - 1)]
        self._error: BaseException | None = None
        self._closed = False
        self._helpers = [threading.Thread(target=self._serve, args=(t,), name=f"nbdist-sum-{t}", daemon=True)
                         for t in range(1, threads)]
        for h in self._helpers:
            h.start()

    def run(self, passes: Sequence[Pass]) -> None:
        """Every pass done, range by range over the threads (the caller takes the first of each)."""
        spans = [split(lo, hi, self.threads, self.minimum) for lo, hi, _ in passes]
        if all(len(s) == 1 for s in spans):  # too short to pay for a wake-up
            for lo, hi, fn in passes:
                fn(lo, hi)
            return

        def job(t: int) -> None:
            for (_, _, fn), ranges in zip(passes, spans):
                if t < len(ranges):
                    fn(*ranges[t])

        self._job, self._error = job, None
        for done, go in zip(self._done, self._go):
            done.clear()
            go.set()
        try:
            job(0)
        finally:
            for done in self._done:
                if not done.wait(self.timeout):
                    raise TimeoutError(f"a summing thread took over {self.timeout:.0f} s")
        if self._error is not None:
            raise self._error

    def _serve(self, t: int) -> None:
        go, done = self._go[t - 1], self._done[t - 1]
        while True:
            while not go.wait(1.0):  # a timeout so the loop sees close() even if it was missed
                if self._closed:
                    return
            go.clear()
            if self._closed:
                return
            try:
                assert self._job is not None
                self._job(t)
            except BaseException as exc:  # handed to the caller, which raises it
                self._error = exc
            finally:
                done.set()

    def close(self) -> None:
        self._closed = True
        for go in self._go:
            go.set()
        for h in self._helpers:
            h.join(timeout=5)


def run_passes(passes: Sequence[Pass], threads: PhaseThreads | None) -> None:
    """Do a phase's passes: on this thread alone, or split over ``threads``."""
    if threads is None:
        for lo, hi, fn in passes:
            fn(lo, hi)
    else:
        threads.run(passes)
