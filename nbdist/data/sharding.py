"""How many workers a run uses and which rows and batches each takes: the run's world (``run_world``),
shard bounds, every global batch dealt over the workers, a PyDataset's shares and its epoch hooks."""
from __future__ import annotations

import contextlib
import random
import sys
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import NbdistError


def shard_bounds(n: int, shards: int) -> list[tuple[int, int]]:
    """Split ``n`` rows into ``shards`` contiguous ranges whose sizes differ by at most one."""
    if shards < 1:
        raise ValueError("shards must be >= 1")
    base, extra = divmod(n, shards)
    bounds, start = [], 0
    for i in range(shards):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def batch_bounds(n: int, batch_size: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous ranges of whole batches of ``batch_size`` rows (the last one short), the batches spread
    as ``shard_bounds`` spreads rows: every worker's batches are batches of one pass over all the rows,
    so what Keras computes per batch is the same sharded or not. Ranges are empty when there are fewer
    batches than shards."""
    return [(min(n, a * batch_size), min(n, b * batch_size))
            for a, b in shard_bounds(batches_per_epoch(n, batch_size), shards)]


# What bounds a run's world, and how the line that says so names it.
WORLD_LIMITS = {
    "batch": "the global batch (batch_size={n}) has {n} row{s}, and each step is split into one part per worker",
    "rows": "the {what} has {n} row{s}",
    "batches": "the PyDataset has {n} batch{es} per epoch, and each worker reads whole batches",
}


def run_world(asked: int, limits: dict[str, int], what: str = "training data") -> tuple[int, str | None]:
    """The workers a run uses: as many as ``asked``, but never more than its data can give each a part
    of (``limits``: a global batch's rows, the rows, a PyDataset's batches; see ``WORLD_LIMITS``). Fewer
    workers keep the run's meaning (each step is still the global batch; with one worker it is the local
    fit's step). Returns the world and the one line that says why it is smaller than asked (None: as asked)."""
    bounds = {name: int(n) for name, n in limits.items() if n is not None and int(n) >= 1}
    world = min([int(asked), *bounds.values()])
    if world >= asked:
        return int(asked), None
    name = min(bounds, key=lambda k: (bounds[k], list(WORLD_LIMITS).index(k)))
    n = bounds[name]
    why = WORLD_LIMITS[name].format(n=n, s="" if n == 1 else "s", es="" if n == 1 else "es", what=what)
    return world, f"nbdist: {world} worker{'' if world == 1 else 's'} instead of {asked}: {why}."


def check_workers(n: int, workers: int, what: str = "training data") -> None:
    if workers > n:
        raise NbdistError(
            f"{workers} workers but only {n} examples in the {what}; use --workers {max(1, n)} or fewer."
        )


def batches_per_epoch(samples: int, batch_size: int) -> int:
    return -(-samples // batch_size)


def rank_batch_sizes(global_batch: int, world: int) -> list[int]:
    """Each worker's share of a global batch: sizes differing by at most one, larger first."""
    if global_batch < world:
        raise NbdistError(f"batch_size {global_batch} cannot be split over {world} workers; use a batch_size of "
                          f"at least {world} (it is the global batch, split over the workers).")
    base, extra = divmod(global_batch, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


def deal_rows(n: int, global_batch: int, world: int) -> list[np.ndarray]:
    """Row indices per worker such that global batch i (rows i*B .. i*B+B-1) is split over the workers
    in order, the last short batch too: worker r's batch i is its part of global batch i, so a step
    of all workers together sees the rows of one local ``fit`` step."""
    return [dealt_rows(n, global_batch, world, r) for r in range(world)]


def dealt_rows(n: int, global_batch: int, world: int, rank: int) -> np.ndarray:
    """Worker ``rank``'s rows of ``deal_rows`` (a local worker computes its own from a memory-mapped file's job)."""
    sizes = rank_batch_sizes(global_batch, world)
    first, size = sum(sizes[:rank]), sizes[rank]
    full, rest = divmod(n, global_batch)
    rows = (np.arange(full, dtype=np.int64)[:, None] * global_batch + first + np.arange(size, dtype=np.int64)).ravel()
    if rest:
        rows = np.concatenate([rows, np.array_split(np.arange(full * global_batch, n, dtype=np.int64), world)[rank]])
    return rows


def share_count(batches: int, rank: int, world: int) -> int:
    """Batches of an epoch worker ``rank`` reads: indices rank, rank + world, ... (strided)."""
    return len(range(rank, batches, world))


def epoch_order(batches: int, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The batch indices of one epoch, the same on every worker: shuffled by (seed, epoch) as Keras
    shuffles a PyDataset's batch order when ``shuffle=True``, else in order."""
    order = np.arange(batches, dtype=np.int64)
    if shuffle:
        np.random.default_rng([int(seed), int(epoch)]).shuffle(order)
    return order


def epoch_window(batches: int, steps: int | None, first_pass: int, first_batch: int,
                 epoch: int) -> tuple[int, int, int]:
    """(pass, from, to): the batches of one pass that ``epoch`` reads, counted from the fit's first epoch. Without
    ``steps`` a whole pass per epoch (pass = epoch); with fit's ``steps_per_epoch`` that many where the last epoch
    stopped, from batch ``first_batch`` of pass ``first_pass`` on (the driver checked that no epoch crosses a
    pass's end: ``driver/fit_call.py uniform_epoch_steps``)."""
    if not steps:
        return epoch, 0, batches
    done, start = divmod(first_batch + epoch * steps, batches)
    return first_pass + done, start, min(start + steps, batches)


def epoch_hook(hook: Callable[[], Any], seed: int, epoch: int) -> None:
    """A PyDataset's ``on_epoch_begin`` or ``on_epoch_end`` called with Python's, numpy's (and torch's, if imported)
    global generators seeded by (``seed``, ``epoch``, the hook's name), then given back their state. Every worker
    holds its own copy of the dataset: a hook that shuffles with them (``np.random.shuffle(self.indexes)``, Keras'
    image iterators) orders the rows alike on every worker, so the shares stay disjoint as in the notebook's one
    copy; the workers' own draws (augmentation, dropout) are untouched."""
    name = zlib.crc32(getattr(hook, "__name__", "").encode())
    keys = np.random.SeedSequence([int(seed) % 2**64, int(epoch) % 2**64, name]).generate_state(3)
    python, numpy = random.getstate(), np.random.get_state()
    torch = sys.modules.get("torch")
    try:
        with contextlib.ExitStack() as stack:
            random.seed(int(keys[0]))
            np.random.seed(int(keys[1]))
            if torch is not None:
                stack.enter_context(torch.random.fork_rng(devices=[]))
                torch.manual_seed(int(keys[2]))
            hook()
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


def share_indices(order: np.ndarray, rank: int, world: int) -> np.ndarray:
    """Worker ``rank``'s batches of an epoch, strided: step j of all workers reads
    ``order[j*world : (j+1)*world]``, so one step consumes ``world`` consecutive batches of the epoch."""
    return order[rank::world]


def strided_batches(shares: list[list[Any]]) -> list[Any]:
    """The batches of one unshuffled pass in the dataset's order, from each worker's share of them in
    its order (``share_indices``): batch i is worker ``i % world``'s batch ``i // world``."""
    world = len(shares)
    return [shares[i % world][i // world] for i in range(sum(len(s) for s in shares))]
