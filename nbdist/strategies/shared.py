"""Sum a small bucket across workers of one machine through shared memory: no messages at all.

The one-round sum of ``direct.py`` still sends messages over loopback TCP, and a worker waiting
for one blocks in the kernel: its virtual CPU halts, and on this machine's VMs (idle vCPUs halt
at once, ``haltpoll.guest_halt_poll_ns=0``) waking it costs from 0.5 to 8 ms. When every worker
runs on the same machine they can instead share one memory segment: each writes its bucket into
its own row and publishes the call's number in its own counter; the others watch the counter
and add the rows in rank order, so every worker computes the same sum bit for bit. A worker
with a core of its own spins while it waits (briefly, then sleeps), so it never halts.

Layout of the segment: one int64 counter per worker, each on its own 64-byte line, then two
slots of ``world`` rows. Call k writes slot k % 2. A worker starts call k + 1 only after every
peer has published call k, hence after every peer has finished reading call k - 1, the slot
k + 1 overwrites: two slots and one counter per worker are all the synchronisation needed.

Ordering: the bucket is written before the counter, and a reader loads the counter before the
rows. x86-64 keeps stores in order and loads in order (TSO), so that is enough there; other
architectures would need memory barriers Python cannot issue, so they keep the message path.

The segment lives in /dev/shm only until every worker has mapped it (mode 0600, a random name);
then it is unlinked, so a killed job leaves nothing behind. Nothing in it is ever unpickled:
it holds raw float32 and int64.
"""
from __future__ import annotations

import json
import logging
import mmap
import os
import platform
import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..placement import usable_cores
from ..procs import ProcessId, remove_quietly
from .direct import add_in_rank_order

log = logging.getLogger(__name__)

LINE = 64  # bytes: one counter per cache line, and every row starts on one
SHM_DIR = "/dev/shm"
# How long a waiting worker spins before it sleeps. Gradient exchanges wait about a millisecond
# for the slowest peer; a wait much longer than that (a peer still validating, or saving a
# checkpoint) is not worth a busy core.
SPIN_SECONDS = 0.02
CHECK_EVERY = 4096  # spin iterations between looks at the clock (about 0.3 ms of Python)


class PeerGone(RuntimeError):
    """A peer exited while this worker waited for its bucket."""


def supported_here() -> bool:
    """Whether this machine orders plain stores and loads as the protocol needs (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def segment_bytes(world: int, length: int) -> int:
    """Size of the segment: the counters, then two slots of ``world`` rows of ``length`` float32."""
    return LINE * world + 2 * world * row_stride(length)


def row_stride(length: int) -> int:
    return -(-4 * length // LINE) * LINE


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


class SharedMemorySum:
    """``bucket[:] = sum over workers of bucket`` for workers that map the same segment.

    Every worker must call it with a bucket of ``length`` float32 the same number of times.
    Build it with ``open_shared_sum``, which falls back to None when the workers cannot share.
    """

    def __init__(self, rank: int, world: int, length: int, buf: mmap.mmap, peers: Sequence[ProcessId | None],
                 timeout: float, spin: bool) -> None:
        self.rank, self.world, self.length = rank, world, length
        self.timeout, self.spin = timeout, spin
        self._map = buf
        self._peers = list(peers)
        self._seq = np.ndarray((world,), dtype=np.int64, buffer=buf, offset=0, strides=(LINE,))
        stride = row_stride(length)
        self._slots = [np.ndarray((world, length), dtype=np.float32, buffer=buf,
                                  offset=LINE * world + s * world * stride, strides=(stride, 4))
                       for s in (0, 1)]
        self._calls = int(self._seq[rank])

    def __call__(self, bucket: np.ndarray) -> None:
        k = self._calls + 1
        rows = self._slots[k % 2]
        rows[self.rank] = bucket
        self._seq[self.rank] = k  # after the row: peers that see k see the row too (TSO)
        for p in range(self.world):
            if p != self.rank and self._seq[p] < k:
                self._wait(p, k)
        add_in_rank_order(rows, bucket)
        self._calls = k

    def _wait(self, peer: int, k: int) -> None:
        seq, start = self._seq, time.monotonic()
        if self.spin:
            spins = 0
            while seq[peer] < k:
                spins += 1
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
        if waited > self.timeout:
            raise TimeoutError(f"worker {peer} sent no gradients for {waited:.0f} s "
                               f"(the collective timeout); it may be stuck")

    def close(self) -> None:
        self._seq = self._slots = None  # type: ignore[assignment]  # views must go before the map
        try:
            self._map.close()
        except BufferError:  # a view still alive (e.g. held by a traceback): the OS frees it at exit
            log.debug("shared bucket still referenced at close")


def open_shared_sum(collective: Any, length: int) -> SharedMemorySum | None:
    """Map one segment on every worker of ``collective`` (a GlooCollective), or None if any cannot.

    Collective: every worker calls it at the same point. It fails over to None when the workers
    are on different machines or containers (the segment or a peer's process is not visible), or
    the machine is not x86-64; the caller then uses the message path.
    """
    rank, world, store = collective.rank, collective.world_size, collective.store
    n = collective.next_key("shm")
    me = ProcessId.of(os.getpid())
    cores = sorted(usable_cores() or ())
    size = segment_bytes(world, length)
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
    ok = np.array([1.0 if buf is not None and visible else 0.0], dtype=np.float32)
    collective.allreduce_sum(ok)  # every worker mapped the segment, or none uses it
    if rank == 0 and path:
        remove_quietly(path)
    if ok[0] != world:
        if buf is not None:
            buf.close()
        log.debug("gradient exchange by messages: the workers cannot share memory")
        return None
    spin = should_spin([frozenset(i["cores"]) for i in infos])
    return SharedMemorySum(rank, world, length, buf, peers, collective.timeout, spin)


def boot_id() -> str:
    """This kernel's random boot id: the same in every container and namespace of one machine, else different."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _create(path: str, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except OSError as exc:
        log.debug("cannot create %s: %s", path, exc)
        return None
    try:
        # Reserve the pages now: a sparse tmpfs file that cannot grow later kills with SIGBUS.
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    except OSError as exc:  # /dev/shm too small for the segment (a container's default 64 MiB)
        log.debug("cannot size %s: %s", path, exc)
        remove_quietly(path)
        return None
    finally:
        os.close(fd)


def _attach(path: str, size: int) -> mmap.mmap | None:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:  # another machine, or another container's /dev/shm
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        return mmap.mmap(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
