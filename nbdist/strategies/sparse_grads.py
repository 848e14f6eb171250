"""Sparse gradients (``tf.IndexedSlices``) under allreduce: the slices one local step on the global batch holds.

Adam's and Adagrad's updates depend on how a gradient is cut into slices, so the distributed step hands Keras
the local step's slices: a per-row segment (indices from the batch) is every worker's slices, scaled by its
share, in rank order; a broadcast segment (indices from constants or shapes) is their sum under the same
indices, once. Which kind a segment is, is read once from the traced train step (``from_batch``).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# Ops through which the indices' dependence on the data is only on its shape, never on its values.
SHAPE_OPS = frozenset({"Shape", "ShapeN", "Size", "Rank", "TensorListLength", "TensorArraySizeV3"})
# Ops whose outputs are the data itself (a train step traced in the same graph as its input iterator).
DATA_OPS = frozenset({"IteratorGetNext", "IteratorGetNextSync", "OptionalGetValue", "IteratorGetNextAsOptional"})
# Ops the tape puts between one lookup's indices and the aggregated gradient's (TensorFlow's
# ``_aggregate_grads``: a concatenation, with a cast when the segments' index types differ).
PASS_OPS = frozenset({"Cast", "Identity"})

Layout = tuple[tuple[bool, ...], ...]  # per sparse gradient: its segments, True where per row


def segments(indices: Any) -> list[Any]:
    """The lookups' index tensors that a traced gradient's ``indices`` concatenates, in order."""
    op = indices.op
    if op.type in PASS_OPS:
        return segments(op.inputs[0])
    if op.type == "ConcatV2" and _constant(op.inputs[-1]) == 0:
        return [s for t in op.inputs[:-1] for s in segments(t)]
    return [indices]


def from_batch(tensor: Any) -> bool:
    """Whether a traced tensor depends on the values of the step's data (see the module's docstring).

    A walk back through the graph's ops; a captured tensor is followed into the graph it came from (a
    train step traced inside the function that reads its iterator), a variable's handle ends the walk.
    """
    import tensorflow as tf

    seen: set[int] = set()
    todo = [tensor]
    while todo:
        t = todo.pop()
        if id(t) in seen:
            continue
        seen.add(id(t))
        op = t.op
        if op.type in DATA_OPS:
            return True
        if op.type in SHAPE_OPS:
            continue
        if op.type == "Placeholder":
            outer = _captured_from(t)
            if outer is None:
                if _is_function_input(t):
                    return True
                continue
            if tf.is_symbolic_tensor(outer):  # not a variable's handle or an eager constant
                todo.append(outer)
            continue
        todo.extend(op.inputs)
    return False


def _captured_from(placeholder: Any) -> Any:
    """The outer tensor a function graph's placeholder captures, or None for a true argument."""
    for external, internal in getattr(placeholder.graph, "captures", ()):
        if internal is placeholder:
            return external
    return None


def _is_function_input(placeholder: Any) -> bool:
    return any(t is placeholder for t in getattr(placeholder.graph, "inputs", ()))


def _constant(t: Any) -> Any:
    import tensorflow as tf

    value = tf.get_static_value(t)
    return None if value is None else int(value)


class SliceExchange:
    """Hands every worker the local step's slices of each sparse gradient (see the module's docstring).

    ``layout``: each sparse gradient's segments and their kinds, read from the first traced step and the
    same for every worker (one model); a pad step, run eagerly with empty slices, takes part with it.

    What Keras does with them: its TensorFlow backend keeps an ``IndexedSlices`` through elementwise ops and
    applies it with ``scatter_*`` (keras/src/backend/tensorflow/sparse.py, optimizer.py). Adam's, AdamW's and
    RMSprop's ``square(gradient)`` squares each slice before duplicates are summed, Adagrad scatter-adds
    each slice's square: their state takes the sum of the squares of a row's slices, not the square of its
    summed gradient. So the update depends on how the gradient is cut into slices, not only on its sum (SGD,
    with or without momentum, is linear and does not care), and the distributed step must hand Keras the
    slices the local step would.

    What the local step's slices are: TensorFlow's tape gives one segment of slices per lookup of the table
    (``tf.gather``'s gradient: the looked-up indices flattened, one slice each) and concatenates the segments
    of a table looked up several times (a table shared by two inputs, or token and position lookups of one
    table), always in the same order. A segment is one of two kinds:

    - **per row**: the indices come from the batch (token ids, user ids): one slice per id of each row, holding
      that row's gradient. The workers' rows of a global batch are its rows dealt in rank order
      (``data.dealt_rows``), so every worker's segment, scaled by its share n / N, concatenated in rank order,
      is the local segment, slice for slice.
    - **broadcast**: the indices do not come from the batch (a position embedding looked up on
      ``arange(maxlen)`` once per step): one slice per index, holding the gradient summed over the batch's
      rows. The local segment is the sum of the workers' (each scaled by n / N) under the same indices, once:
      concatenated, Adam would square each worker's part separately.

    How a segment is told: from the traced train step, once, by what its indices are computed from. A segment
    is per row when its indices depend on the values of the step's data (the train function's inputs, or an
    input iterator), and broadcast when they depend only on constants, variables or the data's *shape*
    (``arange(shape(x)[1])``). Looking at the values of a step instead could not tell them apart: per-row ids
    may repeat the same indices on every worker (a constant feature), and a broadcast segment's length may
    equal a batch's. A run with ``run_eagerly=True`` has no graph to read: every segment counts as per row there
    (a position embedding then differs from the local step on 2+ workers; said once in the log).
    """

    def __init__(self, collective: Any) -> None:
        self.collective = collective
        self.layout: Layout | None = None
        self._warned = False

    # -- TensorFlow side -----------------------------------------------------------------------
    def reduce(self, grads: Sequence[Any], exchange: Callable[[Sequence[np.ndarray]], list[np.ndarray]]) -> list[Any]:
        """The sparse gradients ``grads`` as one local step on the global batch would hold them.

        ``exchange``: calls ``self.exchange`` with the step's rows and scale (the reducer knows them).
        """
        import tensorflow as tf

        if self.collective.world_size == 1:
            return list(grads)  # nothing to join: the local step's slices already
        parts, layout, kinds_out = [], [], []
        for g in grads:
            if tf.executing_eagerly():
                kinds = self._eager_kinds(len(layout))
                lengths = tf.concat([tf.shape(g.indices, out_type=tf.int64)[:1],
                                     tf.zeros([len(kinds) - 1], tf.int64)], 0)
            else:
                segs = segments(g.indices)
                kinds = tuple(from_batch(s) for s in segs)
                lengths = tf.stack([tf.shape(s, out_type=tf.int64)[0] for s in segs])
            layout.append(kinds)
            flat = tf.float64 if g.values.dtype == tf.float64 else tf.float32  # a float64 model's stay float64
            parts += [tf.cast(tf.reshape(g.indices, [-1]), tf.int64), tf.cast(g.values, flat), lengths]
            kinds_out += [tf.int64, flat]
        self._settle(tuple(layout))
        out = tf.numpy_function(exchange, parts, Tout=kinds_out, stateful=True,
                                name="nbdist_gather_slices")
        result = []
        for k, g in enumerate(grads):
            indices, values = out[2 * k], out[2 * k + 1]
            indices.set_shape([None])
            values = tf.reshape(values, tf.concat([[-1], tf.shape(g.values)[1:]], 0))
            values.set_shape(tf.TensorShape([None]).concatenate(g.values.shape[1:]))
            result.append(tf.IndexedSlices(tf.cast(values, g.values.dtype), tf.cast(indices, g.indices.dtype),
                                           g.dense_shape))
        return result

    def _eager_kinds(self, k: int) -> tuple[bool, ...]:
        """An eager step's segments: a traced step's layout (a pad step's empty slices fill its first
        segment), or, in a run that never traces (``run_eagerly``), one per-row segment."""
        if self.layout is not None:
            return self.layout[k]
        if not self._warned:
            self._warned = True
            log.warning("the train step runs eagerly: every lookup's sparse gradient is joined as per-row ids; "
                        "a lookup on positions (not on the batch) then differs from one local step")
        return (True,)

    def _settle(self, layout: Layout) -> None:
        if self.layout is None:
            self.layout = layout
            log.info("sparse gradients' lookups (True: per row, False: broadcast): %s", layout)
        elif layout != self.layout:
            raise RuntimeError(f"the sparse gradients' lookups changed between steps: {layout} after {self.layout}")

    # -- numpy side ----------------------------------------------------------------------------
    def exchange(self, arrays: Sequence[np.ndarray], rows: float, scale: float | None) -> list[np.ndarray]:
        """(indices, values, segment lengths) per sparse gradient in; (indices, values) of the local step out.

        ``rows``: this worker's rows in the step (a pad step has none and contributes no slices);
        ``scale``: n / N for values not yet scaled by it, else None. Two sums: every worker's segment
        lengths, then one float64 buffer where each worker fills its own blocks (indices and values are exact
        in float64; the other workers add zeros). Values come back in the dtype they came in.
        """
        assert self.layout is not None
        world, rank = self.collective.world_size, self.collective.rank
        grads = []
        for k in range(len(self.layout)):
            indices, values, lengths = arrays[3 * k], np.asarray(arrays[3 * k + 1]), arrays[3 * k + 2]
            values = values.reshape(len(values), int(np.prod(values.shape[1:], dtype=np.int64)))
            grads.append((np.reshape(indices, -1), values, np.reshape(lengths, -1).astype(np.int64)))
        kinds = [kind for layout in self.layout for kind in layout]
        counts = np.zeros((world, len(kinds)), dtype=np.int64)
        if rows > 0:
            counts[rank] = np.concatenate([lengths for _, _, lengths in grads])
        self.collective.allreduce_sum(counts)
        widths = [1 + values.shape[1] for k, (_, values, _) in enumerate(grads) for _ in self.layout[k]]
        sizes = counts * np.asarray(widths, dtype=np.int64)[None, :]  # [rank, segment] elements
        starts = np.concatenate([[0], np.cumsum(sizes.T.reshape(-1))])  # segment-major, then rank
        buf = np.zeros(int(starts[-1]), dtype=np.float64)
        j = 0
        for indices, values, lengths in grads:
            factor = None if scale is None else values.dtype.type(scale)
            offset = 0
            for length in lengths:
                if rows > 0 and length:
                    a = int(starts[j * world + rank])
                    block = buf[a:a + int(length) * widths[j]].reshape(int(length), widths[j])
                    block[:, 0] = indices[offset:offset + length]
                    part = values[offset:offset + length]
                    block[:, 1:] = part if factor is None else part * factor
                offset += int(length)
                j += 1
        self.collective.allreduce_sum(buf)
        out: list[np.ndarray] = []
        j = 0
        for k in range(len(grads)):
            ix, vals = [], []
            for per_row in self.layout[k]:
                blocks = [buf[int(starts[j * world + r]):int(starts[j * world + r + 1])].reshape(-1, widths[j])
                          for r in range(world)]
                for block in self._segment(blocks, per_row):
                    ix.append(block[:, 0])
                    vals.append(block[:, 1:])
                j += 1
            width, dtype = grads[k][1].shape[1], grads[k][1].dtype
            out += [np.concatenate(ix).astype(np.int64) if ix else np.zeros(0, np.int64),
                    np.ascontiguousarray(np.concatenate(vals) if vals else np.zeros((0, width)), dtype=dtype)]
        return out

    def _segment(self, blocks: list[np.ndarray], per_row: bool) -> list[np.ndarray]:
        """One segment of the local step from every worker's block of it (rank order)."""
        present = [b for b in blocks if len(b)]
        if per_row or len(present) < 2:
            return present
        first = present[0]
        if all(len(b) == len(first) and np.array_equal(b[:, 0], first[:, 0]) for b in present[1:]):
            joined = first.copy()
            joined[:, 1:] = np.sum([b[:, 1:] for b in present], axis=0)
            return [joined]
        if not self._warned:  # not one index set: a lookup the workers draw differently (a random one)
            self._warned = True
            log.warning("a lookup not on the batch's rows has different indices on different workers; its "
                        "slices are joined as per-row ones")
        return present
