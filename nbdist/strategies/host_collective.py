"""Workers of one machine meet and sum without torch: a directory for agreements, shared memory for sums.

Used when every worker runs on the notebook's machine (the local backend) and torch is not installed
(a JAX-only or TensorFlow-only install): ``HostCollective`` has the ``Collective`` interface of
``collective.py`` (``allreduce_sum``, ``broadcast``, ``store``, ``next_key``), its store a private
directory in /dev/shm that rank 0 makes (mode 0700) and the driver relays, its sums ``shared.py``'s
segments: the same additions in rank order, so every worker gets the same bits. A broadcast is a sum in
which only the root adds its values. Nothing read from the directory or the segments is unpickled.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .collective import GenerationBroken, broken_word
from .shared import CHUNK_ELEMENTS, SHM_DIR, open_chunked_sum, open_shared_sum, supported_here

PREFIX = "nbdist-meet-"


class DirectoryStore:
    """``set``/``get`` of small values through files of one directory; ``get`` waits, at most ``timeout`` s."""

    def __init__(self, path: str, timeout: float, broken: Callable[[], str | None] = lambda: None) -> None:
        self.path, self.timeout, self.broken = path, timeout, broken

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key.replace("/", "%"))

    def set(self, key: str, value: str | bytes) -> None:
        data = value.encode() if isinstance(value, str) else value
        fd, tmp = tempfile.mkstemp(dir=self.path, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, self._file(key))  # whole or absent: a reader never sees half a value

    def get(self, key: str) -> bytes:
        path, start, pause = self._file(key), time.monotonic(), 1e-4
        while True:
            try:
                with open(path, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                why = self.broken()
                if why:
                    raise GenerationBroken(why) from None
                if time.monotonic() - start > self.timeout:
                    raise TimeoutError(f"no worker wrote {key!r} in {self.timeout:.0f} s (the collective "
                                       "timeout); a worker may have died before it met the others") from None
                time.sleep(pause)
                pause = min(2 * pause, 0.01)


def make_meeting_place() -> str:
    """Rank 0's private directory for the run's agreements (relayed to the others by the driver)."""
    return tempfile.mkdtemp(prefix=PREFIX, dir=SHM_DIR if os.path.isdir(SHM_DIR) else None)


def remove_meeting_place(path: str) -> None:
    """Remove a directory ``make_meeting_place`` made (the driver's cleanup too); anything else is left alone."""
    if path and os.path.basename(os.path.normpath(path)).startswith(PREFIX):
        shutil.rmtree(path, ignore_errors=True)


class HostCollective:
    """Sums and broadcasts between the workers of one machine through shared memory (module docstring)."""

    def __init__(self, rank: int, world_size: int, path: str, timeout: float) -> None:
        if not supported_here():
            raise RuntimeError("the workers meet through shared memory, which this machine cannot order "
                               "(not x86-64); install torch for its Gloo collectives: pip install 'nbdist[torch]'")
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.path = path
        # An elastic run's word that its generation is broken (worker/elastic.py): why, else None.
        self.broken: Callable[[], str | None] | None = None
        self._store = DirectoryStore(path, timeout, lambda: broken_word(self))
        self._keys = 0
        self._sums: dict[Any, Any] = {}

    @property
    def store(self) -> DirectoryStore:
        return self._store

    def next_key(self, prefix: str) -> str:
        """A store key no earlier call on this worker used; every worker gets the same sequence."""
        self._keys += 1
        return f"nbdist/{prefix}/{self._keys}"

    def allreduce_sum(self, buf: np.ndarray) -> None:
        if not buf.size:
            return
        if not buf.flags.c_contiguous:
            flat = np.ascontiguousarray(buf)
            self.allreduce_sum(flat)
            buf[...] = flat
            return
        # float32 (gradients, weights) and a float64 model's weights, larger than a chunk, chunk by chunk; counts
        # and exact sums in one small segment per dtype and size (a whole 2-slot copy per worker: small only)
        chunked = buf.dtype == np.float32 or (buf.dtype == np.float64 and buf.size > CHUNK_ELEMENTS)
        key = ("chunked", buf.dtype.str) if chunked else (buf.dtype.str, buf.size)
        if key not in self._sums:
            self._sums[key] = self._opened(open_chunked_sum(self, CHUNK_ELEMENTS, dtype=buf.dtype) if chunked
                                           else open_shared_sum(self, buf.size, buf.dtype))
        self._sums[key](buf.reshape(-1))

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        if self.rank != root:
            buf[...] = 0
        self.allreduce_sum(buf)  # x + 0 is x: the root's values, bit for bit

    def _opened(self, summer: Any) -> Any:
        if summer is None:
            raise RuntimeError("the workers could not share memory (/dev/shm full, or not one machine); "
                               "install torch for its Gloo collectives: pip install 'nbdist[torch]'")
        return summer

    def close(self) -> None:
        for summer in self._sums.values():
            summer.close()
        self._sums = {}
        if self.rank == 0:
            remove_meeting_place(self.path)
