"""Sum buckets across workers of one machine through shared memory: no messages at all.

``SharedMemorySum`` sums a small bucket through one row per worker; ``SharedChunkedSum`` a large one chunk by
chunk (reduce-scatter, then all-gather), reading the arrays where they are. Invariants: every worker adds the
rows in rank order, so all get the same bits (the same as each other's and as Gloo's order); a worker waits
for every peer's counter before it reuses a slot, so no slot is read and written at once; x86-64 only (TSO).
The segment lives in /dev/shm only until every worker has mapped it (mode 0600, a random name), and holds raw
floats, never pickles. A dead peer is named while a worker waits for it (``PeerGone``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..machine.placement import usable_cores
from ..machine.processes import ProcessId, remove_quietly
from .collective import GenerationBroken, broken_word
from .shm_files import _attach, _create, boot_id

log = logging.getLogger(__name__)

ALIGN = 16  # float32 elements (64 bytes): every array in a bucket, and every cut of one, starts on a cache line
Pieces = list[tuple[int, int, int, int]]  # (array, from, to, bucket position)


def aligned_offsets(sizes: Sequence[int], align: int = ALIGN) -> np.ndarray:
    """Start of each array in the bucket (each a multiple of ``align``), then the end of the last."""
    starts, at = [], 0
    for size in sizes:
        at = -(-at // align) * align
        starts.append(at)
        at += int(size)
    return np.array(starts + [at], dtype=np.int64)


def pieces(offsets: Sequence[int], sizes: Sequence[int], a: int, b: int) -> Pieces:
    """The parts of the arrays that land in bucket[a:b]: (array, from, to, bucket position)."""
    out = []
    for i, (start, size) in enumerate(zip(offsets, sizes)):
        lo, hi = max(a, int(start)), min(b, int(start) + int(size))
        if lo < hi:
            out.append((i, lo - int(start), hi - int(start), lo))
    return out


def block_bounds(length: int, world: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """``range(length)`` cut into ``world`` consecutive blocks of nearly equal size, cut at ``align``."""
    per = -(-length // world)
    per = -(-per // align) * align
    return [(min(r * per, length), min((r + 1) * per, length)) for r in range(world)]


def segment_bounds(a: int, b: int, segment: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """``range(a, b)`` cut into consecutive segments of at most ``segment`` elements."""
    segment = max(align, segment // align * align)
    return [(s, min(s + segment, b)) for s in range(a, b, segment)]


def add_in_rank_order(rows: np.ndarray, out: np.ndarray) -> None:
    """``out = ((rows[0] + rows[1]) + rows[2]) + ...``: the same order, hence the same bits, everywhere."""
    if len(rows) == 1:
        out[:] = rows[0]
        return
    np.add(rows[0], rows[1], out=out)
    for row in rows[2:]:
        np.add(out, row, out=out)

LINE = 64  # bytes: one counter per cache line, and every row starts on one
SHM_DIR = "/dev/shm"
# How long a waiting worker spins before it sleeps. Gradient exchanges wait about a millisecond
# for the slowest peer; a wait much longer than that (a peer still validating, or saving a
# checkpoint) is not worth a busy core.
SPIN_SECONDS = 0.02
CHECK_EVERY = 4096  # spin iterations between looks at the clock (about 0.3 ms of Python)
# Spin iterations (about 20 us) before a spinning wait starts yielding its core at each look: when another
# program shares the core, it then runs while we wait, instead of after, when the peer is there.
YIELD_AFTER = 256
# Floats per row of the chunked sum's segment; tuned below by benchmarks/shared_sum.py.
CHUNK_ELEMENTS = 2**19  # 2 MiB rows: 0.24-0.38 of raw Gloo for 100 MiB here (benchmarks/shared_sum.py)


class PeerGone(RuntimeError):
    """A peer exited while this worker waited for its bucket."""


def supported_here() -> bool:
    """Whether this machine orders plain stores and loads as the protocol needs (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def segment_bytes(world: int, length: int, itemsize: int = 4) -> int:
    """Size of the segment: the counters, then two slots of ``world`` rows of ``length`` floats."""
    return LINE * world + 2 * world * row_stride(length, itemsize)


def row_stride(length: int, itemsize: int = 4) -> int:
    return -(-itemsize * length // LINE) * LINE


def should_spin(affinities: Sequence[frozenset[int]]) -> bool:
    """Spin only if every worker has a core no peer competes for.

    True when the workers' core sets are pairwise disjoint (pinned, as the local backend pins
    them), or all the same set with a core per worker (unpinned on a large enough machine).
    Otherwise a spinning worker could be taking the very core its peer needs to finish.
    """
    sets = [frozenset(a) for a in affinities]
    if any(not s for s in sets):
        return False
    if all(s == sets[0] for s in sets):
        return len(sets[0]) >= len(sets)
    seen: set[int] = set()
    for s in sets:
        if seen & s:
            return False
        seen |= s
    return True


@dataclass
class ChunkPlan:
    """Where a bucket's chunks come from: for each chunk its bounds, the arrays' parts in it and this worker's slice."""

    length: int
    chunks: list[tuple[int, int, Pieces, int, int]]  # (a, b, pieces, slice lo, slice hi)


def chunk_plan(offsets: Sequence[int], sizes: Sequence[int], length: int, chunk: int, rank: int,
               world: int) -> ChunkPlan:
    """Cut ``range(length)`` into chunks of ``chunk`` floats, each into ``world`` aligned slices."""
    out = []
    for a, b in segment_bounds(0, length, chunk):
        lo, hi = block_bounds(b - a, world)[rank]
        out.append((a, b, pieces(offsets, sizes, a, b), lo, hi))
    return ChunkPlan(length, out)


def chunked_segment_bytes(world: int, chunk: int, itemsize: int = 4) -> int:
    """The counters, then two slots of ``world`` input rows and one output row of ``chunk`` floats."""
    return LINE * world + 2 * (world + 1) * row_stride(chunk, itemsize)


class _SharedSum:
    """A mapped segment: int64 counters (one per worker, one per 64-byte line), waits on them, then each mode's
    rows. What both modes offer, chunk by chunk (``plan``): ``sum_into`` (arrays read where they are, optionally
    scaled), ``average_in_place`` and ``summer(bucket)`` in place. Every worker makes the same calls with the
    same layouts; each mode's ``_exchange`` moves the chunks."""

    def __init__(self, rank: int, world: int, buf: mmap.mmap, peers: Sequence[ProcessId | None],
                 timeout: float, spin: bool) -> None:
        self.rank, self.world = rank, world
        self.timeout, self.spin = timeout, spin
        self.yield_after = YIELD_AFTER
        self._map = buf
        self._peers = list(peers)
        self._seq = np.ndarray((world,), dtype=np.int64, buffer=buf, offset=0, strides=(LINE,))
        self._plans: dict[int, ChunkPlan] = {}  # summer(bucket)'s layouts, by length
        self.broken: Callable[[], str | None] = lambda: None  # the collective's word that its generation is gone

    def _wait_all(self, k: int) -> None:
        """Return once every peer's counter has reached ``k``."""
        for p in range(self.world):
            if p != self.rank and self._seq[p] < k:
                self._wait(p, k)

    def _wait(self, peer: int, k: int) -> None:
        seq, start = self._seq, time.monotonic()
        if self.spin:
            spins, polite = 0, self.yield_after
            while seq[peer] < k:
                spins += 1
                if spins > polite:
                    os.sched_yield()  # a no-op on a core of our own; else the other program runs meanwhile
                if spins % CHECK_EVERY == 0 and time.monotonic() - start > SPIN_SECONDS:
                    break
            else:
                return
        pause, checked = 20e-6, start
        while seq[peer] < k:
            now = time.monotonic()
            if now - checked > 0.1:
                checked = now
                self._check_peer(peer, now - start)
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def _check_peer(self, peer: int, waited: float) -> None:
        who = self._peers[peer]
        if who is not None and not who.alive():
            raise PeerGone(f"worker {peer} (pid {who.pid}) exited during the gradient exchange")
        why = self.broken()
        if why:
            raise GenerationBroken(why)
        if waited > self.timeout:
            raise TimeoutError(f"worker {peer} sent no gradients for {waited:.0f} s "
                               f"(the collective timeout); it may be stuck")

    def close(self) -> None:
        self._seq = self._slots = None  # type: ignore[assignment]  # views must go before the map
        try:
            self._map.close()
        except BufferError:  # a view still alive (e.g. held by a traceback): the OS frees it at exit
            log.debug("shared bucket still referenced at close")


    def plan(self, offsets: Sequence[int], sizes: Sequence[int], length: int) -> ChunkPlan:
        """The chunks of a bucket of ``length`` holding arrays of ``sizes`` at ``offsets``."""
        raise NotImplementedError

    def __call__(self, bucket: np.ndarray) -> None:
        n = len(bucket)
        if n not in self._plans:
            self._plans[n] = self.plan([0], [n], n)
        self.sum_into([bucket], bucket, self._plans[n])

    def sum_into(self, arrays: Sequence[np.ndarray], out: np.ndarray, plan: ChunkPlan,
                 scales: Sequence[Any] | None = None) -> None:
        """``out[layout] = sum over workers of arrays``: flat arrays, laid out as ``plan`` says.

        ``scales``: each array's float32 factor, or None (``fill``). ``out`` may be the one array itself (in
        place): each chunk of it is read before it is written.
        """
        def take(summed: np.ndarray, a: int, b: int, parts: Pieces) -> None:
            np.copyto(out[a:b], summed)

        self._exchange(plan, lambda row, a, parts: fill(row, a, parts, arrays, scales), take, out)

    def average_in_place(self, arrays: Sequence[np.ndarray], weight: float, plan: ChunkPlan) -> float:
        """Every array := the ``weight``-weighted average over workers of that array, in place; the summed weight.

        ``arrays[0]`` must be ``[1.0]`` at position 0 of the plan: its sum, the total weight, is in the
        first chunk summed, so every chunk is divided as it comes back, straight into the arrays
        (one pass in, one out, no bucket). A total of 0 (nobody trained) writes nothing.
        """
        total = [np.float32(0.0)]

        def take(summed: np.ndarray, a: int, b: int, parts: Pieces) -> None:
            if a == 0:
                total[0] = np.float32(round(float(summed[0])))
            if total[0] > 0:
                for k, lo, hi, pos in parts:
                    if k:
                        np.divide(summed[pos - a:pos - a + hi - lo], total[0], out=arrays[k][lo:hi])

        assert plan.chunks and plan.chunks[0][2][:1] == [(0, 0, 1, 0)], "the weight comes first"
        scales = [np.float32(weight)] * len(arrays)
        self._exchange(plan, lambda row, a, parts: fill(row, a, parts, arrays, scales), take)
        return float(total[0])

    def _exchange(self, plan: ChunkPlan, put: Any, take: Any, out: np.ndarray | None = None) -> None:
        """Each chunk ``put`` into this worker's row, summed, and handed to ``take`` (or, where a mode can, summed
        straight into ``out``, which ``take`` would copy it to)."""
        raise NotImplementedError


def fill(row: np.ndarray, a: int, parts: Pieces, arrays: Sequence[np.ndarray], scales: Sequence[Any] | None) -> None:
    """Copy the arrays' ``parts`` of a chunk starting at ``a`` into ``row``, each times its scale (None: as it is;
    0: zeros, as 0 x inf would be NaN), in one pass: the same bits as scaling first."""
    for k, lo, hi, pos in parts:
        dst, factor = row[pos - a:pos - a + hi - lo], None if scales is None else scales[k]
        if factor is None:
            np.copyto(dst, arrays[k][lo:hi])
        elif factor == 0:
            dst.fill(0.0)
        else:
            np.multiply(arrays[k][lo:hi], factor, out=dst, casting="same_kind")


@contextlib.contextmanager
def waiting(collective: Any) -> Iterator[None]:
    """Tell the collective's ``PhaseClock`` (if any) the worker is in a shared-memory sum (it sees no call)."""
    clock = getattr(collective, "clock", None)
    if clock is not None:
        clock.enter()
    try:
        yield
    finally:
        if clock is not None:
            clock.leave()


class SharedMemorySum(_SharedSum):
    """The small mode: rows of the whole bucket (``length`` floats of ``dtype``: float64 for sums that must stay
    exact), one wait per call. Each worker writes its row and publishes the call's number in its counter; every
    worker adds all rows in rank order (the same bits everywhere). Call k writes slot k % 2; a worker starts call
    k + 1 only after every peer published k, hence finished reading k - 1, the slot k + 1 overwrites."""

    def __init__(self, rank: int, world: int, length: int, buf: mmap.mmap, peers: Sequence[ProcessId | None],
                 timeout: float, spin: bool, dtype: Any = np.float32) -> None:
        super().__init__(rank, world, buf, peers, timeout, spin)
        self.length = length
        item = np.dtype(dtype).itemsize
        stride = row_stride(length, item)
        self._slots = [np.ndarray((world, length), dtype=dtype, buffer=buf,
                                  offset=LINE * world + s * world * stride, strides=(stride, item))
                       for s in (0, 1)]
        self._sum = np.zeros(length, dtype=dtype)
        self._calls = int(self._seq[rank])

    def plan(self, offsets: Sequence[int], sizes: Sequence[int], length: int) -> ChunkPlan:
        if length > self.length:
            raise ValueError(f"a bucket of {length} floats in rows of {self.length}")
        return ChunkPlan(length, [(0, length, pieces(offsets, sizes, 0, length), 0, length)])

    def _exchange(self, plan: ChunkPlan, put: Any, take: Any, out: np.ndarray | None = None) -> None:
        for a, b, parts, _, _ in plan.chunks:
            k = self._calls + 1
            rows = self._slots[k % 2]
            put(rows[self.rank], a, parts)
            self._seq[self.rank] = k  # after the row: peers that see k see the row too (TSO)
            self._wait_all(k)
            summed = self._sum[:b - a] if out is None else out[a:b]
            add_in_rank_order(rows[:, :b - a], summed)  # an alignment gap: zeros, or one layout's finite floats
            if out is None:
                take(summed, a, b, parts)
            self._calls = k


class SharedChunkedSum(_SharedSum):
    """The chunked mode, for a large bucket: a fixed segment of two slots of ``world`` input rows and one output
    row of ``chunk`` floats, each chunk summed by reduce-scatter then all-gather: every worker adds its 1/world
    slice (the rows in rank order, as the small mode: the same bits) into the output row, then all copy it out.
    The protocol runs in phases numbered on from the counter's last value. In phase P a worker
      1. waits until every peer has published P - 1,
      2. copies the output row of slot P % 2 (chunk P - 2, summed) into its result,
      3. writes its chunk P into its input row of slot P % 2,
      4. adds its slice of chunk P - 1 from the input rows of slot (P - 1) % 2 into that slot's output row,
      5. publishes P.
    (A call of L chunks takes L + 2 phases; chunks "before the first" and "after the last" are empty.)
    Why it is safe with one counter per worker and two slots: every read and write of phase P happens
    after every peer published P - 1 and before this worker publishes P, so a peer is at most one phase
    ahead. Step 2 reads slices written by peers in phase P - 1 (published); they are next overwritten
    in phase P + 1 (chunk P's slices), which no peer enters before this worker publishes P. Step 3
    overwrites chunk P - 2's inputs, which peers read in phase P - 1 (published); its readers wait for
    P. Step 4 reads inputs written in phase P - 1 (published), overwritten only in phase P + 1; it
    overwrites chunk P - 3's sum, which peers copied out in phase P - 1 (published); its readers wait
    for P + 1. Hence no slot is read and written by two workers at once, for any world size.
    """

    def __init__(self, rank: int, world: int, chunk: int, buf: mmap.mmap, peers: Sequence[ProcessId | None],
                 timeout: float, spin: bool, dtype: Any = np.float32) -> None:
        super().__init__(rank, world, buf, peers, timeout, spin)
        self.chunk = chunk
        item = np.dtype(dtype).itemsize
        stride, rows = row_stride(chunk, item), world + 1
        self._slots = [np.ndarray((rows, chunk), dtype=dtype, buffer=buf,
                                  offset=LINE * world + s * rows * stride, strides=(stride, item))
                       for s in (0, 1)]
        self._phase = int(self._seq[rank])

    def plan(self, offsets: Sequence[int], sizes: Sequence[int], length: int) -> ChunkPlan:
        return chunk_plan(offsets, sizes, length, self.chunk, self.rank, self.world)

    def _exchange(self, plan: ChunkPlan, put: Any, take: Any, out: np.ndarray | None = None) -> None:
        """In phase i this worker puts chunk i into its row, adds its slice of chunk i - 1 and hands chunk i - 2,
        summed by everyone, to ``take``; peers move in lockstep."""
        rank, world, chunks = self.rank, self.world, plan.chunks
        g = self._phase
        with np.errstate(all="ignore"):  # alignment gaps hold stale floats: their sums mean nothing
            for i in range(len(chunks) + 2):
                phase = g + 1 + i
                self._wait_all(phase - 1)
                slot, last = self._slots[phase % 2], self._slots[(phase - 1) % 2]
                if i >= 2:  # chunk i - 2, summed by everyone in the last phase
                    a, b, parts, _, _ = chunks[i - 2]
                    take(slot[world][:b - a], a, b, parts)
                if i < len(chunks):
                    a, b, parts, _, _ = chunks[i]
                    put(slot[rank], a, parts)
                if 1 <= i <= len(chunks):  # this worker's slice of chunk i - 1
                    _, _, _, lo, hi = chunks[i - 1]
                    if lo < hi:
                        add_in_rank_order(last[:world, lo:hi], last[world, lo:hi])
                self._seq[rank] = phase  # after the rows: peers that see it see them too (TSO)
        self._phase = g + len(chunks) + 2


def _open_segment(collective: Any, size: int) -> tuple[mmap.mmap, list[ProcessId | None], bool] | None:
    """Map one segment of ``size`` bytes on every worker of ``collective`` (its store), or None if any cannot.

    Collective: every worker calls it at the same point. It fails over to None when the workers
    are on different machines or containers (the segment or a peer's process is not visible), or
    the machine is not x86-64; the caller then uses the message path. Returns the map, the
    workers' processes by rank and whether waits may spin.
    """
    rank, world, store = collective.rank, collective.world_size, collective.store
    n = collective.next_key("shm")
    me = ProcessId.of(os.getpid())
    cores = sorted(usable_cores() or ())
    path, buf = "", None
    if rank == 0:
        if supported_here() and me is not None:
            path = os.path.join(SHM_DIR, f"nbdist-{os.getpid()}-{secrets.token_hex(8)}")
            buf = _create(path, size)
            if buf is None:
                path = ""
        store.set(f"{n}/path", path)  # always: the others wait for it ("" means no segment)
    info = {"pid": me.pid if me else 0, "start": me.start if me else 0, "cores": cores, "boot": boot_id()}
    store.set(f"{n}/rank{rank}", json.dumps(info))
    if rank != 0:
        path = store.get(f"{n}/path").decode()
        buf = _attach(path, size) if path and supported_here() else None
    infos = [json.loads(store.get(f"{n}/rank{r}")) for r in range(world)]
    peers = [ProcessId(i["pid"], i["start"]) if i["pid"] else None for i in infos]
    # One machine: one kernel (boot id), the same /dev/shm (the segment attached) and the peers' processes
    # visible. Never the hostname: containers or namespaces on two machines may share one.
    one_kernel = bool(infos[0].get("boot")) and all(i.get("boot") == infos[0]["boot"] for i in infos)
    visible = one_kernel and all(p is not None and p.alive() for p in peers)
    # Every worker mapped the segment, or none uses it: agreed through the store alone, so a collective whose
    # sums are these segments (host_collective.py) can open its own.
    store.set(f"{n}/ok{rank}", "1" if buf is not None and visible else "0")
    ok = all(store.get(f"{n}/ok{r}") == b"1" for r in range(world))
    if rank != 0:
        store.set(f"{n}/read{rank}", "1")
    else:  # rank 0 holds a TCPStore: it returns (and may close it) only once every peer has read the answer
        for r in range(1, world):
            store.get(f"{n}/read{r}")
        if path:
            remove_quietly(path)
    if not ok:
        if buf is not None:
            buf.close()
        log.debug("sums by messages: the workers cannot share memory")
        return None
    assert buf is not None
    return buf, peers, should_spin([frozenset(i["cores"]) for i in infos])


def open_shared_sum(collective: Any, length: int, dtype: Any = np.float32) -> SharedMemorySum | None:
    """A ``SharedMemorySum`` of ``length`` floats of ``dtype`` on every worker, or None (see ``_open_segment``)."""
    opened = _open_segment(collective, segment_bytes(collective.world_size, length, np.dtype(dtype).itemsize))
    return None if opened is None else _heeding(collective, SharedMemorySum(
        collective.rank, collective.world_size, length, *opened[:2], collective.timeout, opened[2], dtype))


def open_chunked_sum(collective: Any, length: int, chunk: int = CHUNK_ELEMENTS,
                     dtype: Any = np.float32) -> SharedChunkedSum | None:
    """A ``SharedChunkedSum`` for buckets of up to ``length`` floats of ``dtype`` in rows of ``chunk``, or None."""
    chunk = min(max(ALIGN, chunk // ALIGN * ALIGN), -(-length // ALIGN) * ALIGN)
    opened = _open_segment(collective, chunked_segment_bytes(collective.world_size, chunk, np.dtype(dtype).itemsize))
    return None if opened is None else _heeding(collective, SharedChunkedSum(
        collective.rank, collective.world_size, chunk, *opened[:2], collective.timeout, opened[2], dtype))


def _heeding(collective: Any, summer: _SharedSum) -> Any:
    """``summer``'s waits end once ``collective`` is told its generation is broken (an elastic run's)."""
    summer.broken = lambda: broken_word(collective)
    return summer


def open_plan_sum(collective: Any, length: int, plan: Any,
                  dtype: Any = np.float32) -> SharedMemorySum | SharedChunkedSum | None:
    """The plan's shared-memory sum (machine/engines.py) of buckets of ``length`` floats of ``dtype``: one row
    ("small") or chunk by chunk ("chunked"); None where the plan names another engine or the segment could not be
    mapped. Collective: every worker calls it at the same point."""
    inner = getattr(collective, "inner", collective)  # PhaseCollective wraps the engine
    if inner.world_size < 2 or plan.engine != "shared":
        return None
    if plan.mode == "small":
        return open_shared_sum(inner, length, dtype)
    return open_chunked_sum(inner, length, max(ALIGN, plan.bucket_bytes // np.dtype(dtype).itemsize), dtype)
