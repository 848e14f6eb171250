"""Input pipelines given where in-memory data goes (``model.fit(ds)``, ``--data ds``, ``nbdist.train(model, ds)``,
evaluate, predict), read once, in the notebook, into the arrays they yield, which then take the one data
path of arrays: a finite ``tf.data`` pipeline, and a torch ``DataLoader`` over a ``TensorDataset``. A loader
over another map-style dataset (whose ``__getitem__`` may draw random numbers unseen) is split by index over
the workers instead (torch_loaders.py). Sound only for what reading once keeps: a pipeline that draws random
numbers (augmentation in a ``map``) would freeze one draw for every epoch, and one that repeats forever has
no end; both are refused in one sentence. The pipeline's shuffle becomes nbdist's per-epoch shuffle of the
rows (a full one), its batch size the fit's global batch. TensorFlow and torch are imported only then. A
generator as fit's x gives the batches Keras would draw from it for that fit, each a global batch; one as
validation_data, the batches each validation would read (``generator_validation``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import NbdistError
from ..fit_arguments import FitCall, check_count, validates
from .files import memory_budget, not_in_memory, pipeline_message
from .inputs import PyDatasetData, is_py_dataset, make_py_dataset_data, standardize_batch
from .ragged import RaggedRows, concat
from .sharding import rank_batch_sizes
from .structures import leaves

log = logging.getLogger(__name__)

BATCH_OPS = ("BatchDataset", "BatchDatasetV2", "ParallelBatchDataset", "PaddedBatchDataset", "PaddedBatchDatasetV2")


@dataclass(frozen=True)
class PipelineRows:
    """What a pipeline yielded, as Keras reads its batches: x, y and sample weights (None when absent)."""

    x: Any
    y: Any
    sample_weight: Any
    batch_size: int  # rows of its first batch: the fit's global batch
    shuffled: bool  # it shuffles (each epoch, as tf.data's shuffle does by default)


def is_tf_dataset(value: Any) -> bool:
    return not_in_memory(value) == "a tf.data.Dataset"


def is_torch_loader(value: Any) -> bool:
    return not_in_memory(value) == "a torch DataLoader"


def is_split_loader(value: Any) -> bool:
    """A torch DataLoader over a map-style dataset other than a TensorDataset: split by index over the
    workers (torch_loaders.py) rather than read once; an iterable dataset is refused in one sentence."""
    if not is_torch_loader(value):
        return False
    from torch.utils.data import IterableDataset, TensorDataset

    if isinstance(value.dataset, IterableDataset):
        raise NbdistError(f"a torch DataLoader over an IterableDataset ({type(value.dataset).__name__}) cannot be "
                          "split over the workers by index; use a map-style Dataset (__len__ and __getitem__), "
                          "or a keras.utils.PyDataset.")
    return not isinstance(value.dataset, TensorDataset)


def split_loaders(fit: FitCall, world: int, seed: int) -> FitCall:
    """``model.fit``'s arguments with a DataLoader over a map-style dataset (x, validation_data) as the
    PyDataset of its batches' parts for ``world`` workers (torch_loaders.py); others unchanged."""
    from torch.utils.data import RandomSampler

    from .torch_loaders import LoaderShares

    out = fit
    for name, what in (("x", "the training data x"), ("validation_data", "validation_data")):
        loader = getattr(fit, name)
        if not is_split_loader(loader):
            continue
        _check_sampler(loader, what)
        rank_batch_sizes(int(loader.batch_size), world)  # a batch of fewer rows than workers: its sentence
        shares = LoaderShares(loader, world, seed, isinstance(loader.sampler, RandomSampler) and name == "x",
                              int(fit.initial_epoch or 0))
        if name == "x":
            for other in ("y", "sample_weight"):
                if getattr(fit, other) is not None:
                    raise NbdistError(f"model.fit got a torch DataLoader as x and {other} too; drop {other}: the "
                                      "loader's batches hold the labels and weights.")
            out = out.replace(x=shares, batch_size=None, shuffle=False)  # the loader's batch and order
        else:
            out = out.replace(validation_data=shares)
    return out


def loader_batches(loader: Any, what: str, ordered: bool) -> Any:
    """A DataLoader over a map-style dataset for evaluate or predict: the PyDataset of its own batches in
    the dataset's order (torch_loaders.py with one part per batch), which the workers deal by batch.
    ``ordered`` (predict: rows come back in the order read) refuses a shuffling loader in one sentence."""
    from torch.utils.data import RandomSampler

    from .torch_loaders import LoaderShares

    _check_sampler(loader, what)
    if ordered and isinstance(loader.sampler, RandomSampler):
        raise NbdistError(f"{what} is a torch DataLoader with shuffle=True, whose row order is drawn anew at each "
                          "reading; predictions come back in the order read: use shuffle=False.")
    return LoaderShares(loader, 1, 0, False, 0)


def _check_sampler(loader: Any, what: str) -> None:
    """One sentence unless the loader batches rows by batch_size over a sequential or random sampler."""
    from torch.utils.data import RandomSampler, SequentialSampler

    if loader.batch_size is None or type(loader.sampler) not in (RandomSampler, SequentialSampler) or (
            isinstance(loader.sampler, RandomSampler) and (loader.sampler.replacement
                                                           or loader.sampler._num_samples is not None)):
        raise NbdistError(f"{what} is a torch DataLoader with its own sampler; nbdist deals the rows itself: use "
                          "batch_size=N with shuffle=True or False, or pass a keras.utils.PyDataset.")


def is_pipeline(value: Any) -> bool:
    """A pipeline this module reads (or refuses with its own sentence)."""
    return is_tf_dataset(value) or is_torch_loader(value)


def read_any(value: Any, what: str, budget: int | None = None) -> PipelineRows:
    return read_loader(value, what, budget) if is_torch_loader(value) else read_pipeline(value, what, budget)


def check_any(value: Any, what: str) -> None:
    """The refusals that need no reading."""
    if is_torch_loader(value):
        _loader_tensors(value, what)
    else:
        check_pipeline(value, what)


def _loader_tensors(loader: Any, what: str) -> list[Any]:
    """The tensors of a DataLoader that reading once keeps exactly, or one sentence."""
    from torch.utils.data import RandomSampler, SequentialSampler, TensorDataset
    from torch.utils.data._utils.collate import default_collate

    dataset = loader.dataset
    is_split_loader(loader)  # an IterableDataset: its sentence
    if not isinstance(dataset, TensorDataset):
        raise NbdistError(f"{what} is a torch DataLoader over a {type(dataset).__name__}, whose __getitem__ may "
                          "change a row every epoch (random augmentation) and cannot be read once; pass the arrays, "
                          "a DataLoader over a TensorDataset, or a keras.utils.PyDataset.")
    if loader.batch_size is None or type(loader.sampler) not in (RandomSampler, SequentialSampler) or (
            isinstance(loader.sampler, RandomSampler) and (loader.sampler.replacement
                                                           or loader.sampler._num_samples is not None)):
        raise NbdistError(f"{what} is a torch DataLoader with its own sampler; nbdist deals the rows itself: use "
                          "batch_size=N with shuffle=True or False, or pass the arrays.")
    if loader.collate_fn is not default_collate:
        raise NbdistError(f"{what} is a torch DataLoader with its own collate_fn, which nbdist cannot read once "
                          "soundly; pass the arrays it collates, or a keras.utils.PyDataset.")
    rows = len(dataset)
    if loader.drop_last and rows % loader.batch_size:
        raise NbdistError(f"{what} is a torch DataLoader with drop_last=True, which drops {rows % loader.batch_size} "
                          "different rows every epoch; set drop_last=False (or make the rows a multiple of "
                          "batch_size).")
    if not 1 <= len(dataset.tensors) <= 3:
        raise NbdistError(f"{what} is a torch DataLoader over {len(dataset.tensors)} tensors; give it x, (x, y) "
                          "or (x, y, sample_weight).")
    return list(dataset.tensors)


def read_loader(loader: Any, what: str, budget: int | None = None) -> PipelineRows:
    """The rows of a DataLoader over a TensorDataset (its tensors), its batch size and whether it shuffles."""
    from torch.utils.data import RandomSampler

    tensors = _loader_tensors(loader, what)
    limit = memory_budget() if budget is None else budget
    size = sum(t.element_size() * t.nelement() for t in tensors)
    if size > limit:
        raise NbdistError(f"{what} is a torch DataLoader of more than {limit / 2**30:.1f} GiB, which nbdist would "
                          "read into the notebook's memory; pass a Spark DataFrame (streamed from the executors) or "
                          "a keras.utils.PyDataset, whose batches each worker reads itself.")
    parts = standardize_batch(tuple(t.detach().cpu().numpy() for t in tensors), source="a torch DataLoader")
    x, y, weights = (*parts, None, None)[:3]
    return PipelineRows(x, y, weights, int(loader.batch_size), isinstance(loader.sampler, RandomSampler))


def pipeline_ops(dataset: Any) -> set[str]:
    """The op types of the pipeline's graph, its map and filter functions included."""
    import tensorflow as tf

    graph = tf.compat.v1.GraphDef.FromString(dataset._as_serialized_graph().numpy())
    return {n.op for n in graph.node} | {n.op for f in graph.library.function for n in f.node_def}


def random_ops(ops: set[str]) -> list[str]:
    """Ops that draw random numbers (tf.random.*, Keras' Random* layers in a map); tf.data's own
    ShuffleDataset is not one of them."""
    return sorted(op for op in ops if "Random" in op)


def check_pipeline(dataset: Any, what: str) -> set[str]:
    """One sentence unless the pipeline is finite, batched and draws no random numbers (nothing is read);
    returns its op types."""
    import tensorflow as tf

    if int(dataset.cardinality()) == int(tf.data.INFINITE_CARDINALITY):
        raise NbdistError(f"{what} is a tf.data pipeline that repeats forever (.repeat()); drop .repeat(): the "
                          "epochs of model.fit repeat it.")
    try:
        ops = pipeline_ops(dataset)
    except Exception as exc:  # a pipeline tf.data cannot describe (rare): read it without the checks below
        log.warning("could not inspect the tf.data pipeline (%s: %s)", type(exc).__name__, exc)
        ops = set(BATCH_OPS[:1])
    drawn = random_ops(ops)
    if drawn:
        raise NbdistError(f"{what} is a tf.data pipeline that draws random numbers ({', '.join(drawn[:3])}, e.g. "
                          "augmentation in a map): nbdist reads a pipeline into memory once, which would freeze one "
                          "draw for every epoch; put the augmentation in the model (keras.layers.RandomFlip, "
                          "RandomRotation, ...) or pass a keras.utils.PyDataset.")
    if not ops & set(BATCH_OPS):
        raise NbdistError(f"{what} is a tf.data pipeline without .batch(...): model.fit takes each element as a "
                          "batch; batch it, e.g. ds.batch(32).")
    return ops


def read_pipeline(dataset: Any, what: str, budget: int | None = None) -> PipelineRows:
    """The rows of a finite, batched, deterministic tf.data pipeline, or one sentence saying why not."""
    ops = check_pipeline(dataset, what)
    limit = memory_budget() if budget is None else budget
    batches: list[tuple[Any, ...]] = []
    size = 0
    try:
        for batch in dataset.as_numpy_iterator():
            if isinstance(batch, tuple) and len(batch) not in (1, 2, 3):
                raise NbdistError(f"{what} is a tf.data pipeline whose elements have {len(batch)} parts; yield "
                                  "(x, y), (x, y, sample_weight) or x, as model.fit expects.")
            parts = standardize_batch(batch, source="a tf.data pipeline", ragged=True)
            size += sum(a.nbytes for part in parts for a in leaves(part))
            if size > limit:
                raise NbdistError(f"{what} is a tf.data pipeline of more than {limit / 2**30:.1f} GiB, which nbdist "
                                  "would read into the notebook's memory; pass a Spark DataFrame (streamed from the "
                                  "executors) or a keras.utils.PyDataset, whose batches each worker reads itself.")
            batches.append(parts)
    except NbdistError:
        raise
    except Exception as exc:
        raise NbdistError(f"reading {what}, a tf.data pipeline, failed ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); check that it runs locally, e.g. "
                          "next(iter(ds)).") from None
    if not batches:
        raise NbdistError(f"{what} is a tf.data pipeline that yields no batches; it needs at least one.")
    x, y, weights = _join(batches, what, "the tf.data pipeline", " (e.g. padded_batch with padded_shapes)")
    first = len(leaves(batches[0][0])[0])
    return PipelineRows(x, y, weights, first, bool({op for op in ops if "ShuffleDataset" in op}))


def _join(batches: list[tuple[Any, ...]], what: str, source: str, pad_hint: str) -> tuple[Any, Any, Any]:
    """The batches' x, y and sample weights (None where absent), each joined row after row, or one sentence."""
    if len({len(b) for b in batches}) > 1:
        raise NbdistError(f"{what}: {source}'s batches differ in their parts ((x, y) and (x, y, sample_weight)); "
                          "yield the same parts in every batch.")
    try:
        joined = tuple(_concat([b[i] for b in batches]) for i in range(len(batches[0])))
    except ValueError as exc:
        raise NbdistError(f"{what}: {source}'s batches differ in shape beyond their rows ({exc}); pad every batch "
                          f"to one shape{pad_hint} or pass arrays.") from None
    return (*joined, None, None)[:3]


def _concat(parts: list[Any]) -> Any:
    """One structure (array, list or dict of arrays) from a batch's structures, leaf by leaf."""
    first = parts[0]
    if any(p is None for p in parts):  # an optional input given as None stays None
        if not all(p is None for p in parts):
            raise ValueError("an input None in some batches only")
        return None
    if isinstance(first, RaggedRows):  # a tf.RaggedTensor's rows, joined as such (the arrays path splits them)
        return concat(parts)
    if isinstance(first, dict):
        return {k: _concat([p[k] for p in parts]) for k in first}
    if isinstance(first, list):
        return [_concat([p[i] for p in parts]) for i in range(len(first))]
    shapes = {np.shape(p)[1:] for p in parts}
    if len(shapes) > 1:
        raise ValueError(" and ".join(str(s) for s in sorted(shapes)[:2]))
    return np.concatenate(parts, axis=0)


# The most batches read from a generator that never ends, with no steps_per_epoch to say how many Keras takes.
MAX_GENERATOR_BATCHES = 100_000
_END = object()


def is_generator(value: Any) -> bool:
    """A Python generator or iterator (a ``keras.utils.PyDataset`` is dealt by batch instead: inputs.py)."""
    return not_in_memory(value) == "a generator or iterator" and not is_py_dataset(value)


class GeneratorReader:
    """Draws a generator's batches as Keras reads them (``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``), within
    the notebook's memory budget; ``steps``: the fit's argument that bounds what is drawn, named in the refusal."""

    def __init__(self, generator: Any, what: str, steps: str) -> None:
        self.iterator, self.what, self.steps = iter(generator), what, steps
        self.limit, self.size, self.drawn = memory_budget(), 0, 0

    def draw(self, n: int | None) -> list[tuple[Any, ...]]:
        """The next ``n`` batches, or those left (None: to its end); what the generator raises goes up, as
        Keras' fit would raise it."""
        what, out = self.what, []
        while n is None or len(out) < n:
            batch = next(self.iterator, _END)
            if batch is _END:
                break
            if isinstance(batch, (tuple, list)) and len(batch) not in (1, 2, 3):
                raise NbdistError(f"{what} is a generator whose batches have {len(batch)} parts; yield (x, y), "
                                  "(x, y, sample_weight) or x, as model.fit expects.")
            parts = standardize_batch(batch, source="a generator", ragged=True)
            self.size += sum(a.nbytes for part in parts for a in leaves(part))
            self.drawn += 1
            if self.size > self.limit or self.drawn > MAX_GENERATOR_BATCHES:
                raise NbdistError(f"{what} is a generator that yields more than {self.limit / 2**30:.1f} GiB or "
                                  f"{MAX_GENERATOR_BATCHES} batches for this fit, which nbdist would read into the "
                                  f"notebook's memory; pass {self.steps} (Keras draws that many batches each time), "
                                  "or a keras.utils.PyDataset, whose batches each worker reads itself.")
            out.append(parts)
        return out


def read_generator(fit: FitCall) -> PipelineRows:
    """The batches Keras would draw from ``model.fit(generator, ...)``'s generator, read once into arrays. Keras
    draws ``steps_per_epoch`` batches an epoch, the next ones each epoch; without ``steps_per_epoch`` one epoch to
    the generator's end (more epochs would find it empty: refused). Each batch is a global batch split by rows over
    the workers, so every batch but the last must have the first's rows."""
    what = "the training data x"
    streamed = not_in_memory(fit.validation_data)
    if streamed is not None and not is_pipeline(fit.validation_data) and not is_generator(fit.validation_data):
        raise NbdistError(pipeline_message(streamed, "validation_data"))  # said before the generator is drawn from
    epochs = max(0, int(fit.epochs) - int(fit.initial_epoch or 0))
    wanted = None if fit.steps_per_epoch is None else int(fit.steps_per_epoch) * epochs
    batches = GeneratorReader(fit.x, what, "steps_per_epoch").draw(wanted)
    if not batches:
        raise NbdistError(f"{what} is a generator that yields no batches; it needs at least one.")
    if wanted is None and epochs > 1:
        raise NbdistError(f"{what} is a generator that ended after {len(batches)} batches, which leaves the "
                          f"second of epochs={epochs} without data (Keras warns and replays the few batches it "
                          f"peeked at); pass epochs=1, or steps_per_epoch={len(batches)} and a generator that "
                          "repeats.")
    if wanted is not None and len(batches) < wanted:
        raise NbdistError(f"{what} is a generator that ended after {len(batches)} batches, but steps_per_epoch="
                          f"{fit.steps_per_epoch} over {epochs} epochs draws {wanted}; lower steps_per_epoch or "
                          "epochs, or make the generator repeat.")
    rows = [len(leaves(b[0])[0]) for b in batches]
    odd = next((r for r in rows[1:-1] if r != rows[0]), rows[-1] if rows[-1] > rows[0] else None)
    if odd is not None:
        raise NbdistError(f"{what} is a generator whose batches have {rows[0]} rows and {odd}; nbdist splits every "
                          "batch by rows over the workers and needs batches of one size (the last may be "
                          "smaller); yield batches of one size, or pass a keras.utils.PyDataset.")
    x, y, weights = _join(batches, what, "the generator", "")
    return PipelineRows(x, y, weights, rows[0], False)


# Keras' data_adapter_utils.NUM_BATCHES_FOR_TENSOR_SPEC: the batches it peeks at from a generator and then
# replays at the start of every pass over it.
KERAS_PEEKS = 2


class ValidationPasses:
    """The batches each validation of a fit reads from a generator, as a PyDataset of their length: pass p's
    batch i is ``passes[p][i]``; each ``on_epoch_end`` moves to the next pass (the last one stays)."""

    def __init__(self, passes: list[list[tuple[Any, ...]]]) -> None:
        self.passes, self.at = passes, 0

    @property
    def num_batches(self) -> int:
        return len(self.passes[0])

    def __len__(self) -> int:
        return self.num_batches

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return self.passes[self.at][i]

    def on_epoch_begin(self) -> None:
        pass

    def on_epoch_end(self) -> None:
        self.at = min(self.at + 1, len(self.passes) - 1)


def validations(fit: FitCall) -> int:
    """How many epochs of the fit validate (Keras' rule, ``validates``)."""
    freq = fit.validation_freq if isinstance(fit.validation_freq, int) and fit.validation_freq >= 1 else 1
    return sum(1 for e in range(int(fit.initial_epoch or 0), int(fit.epochs)) if validates(e, freq))


def generator_validation(fit: FitCall) -> PyDatasetData:
    """A generator as ``validation_data``, drawn for the batches Keras reads at each validation: each pass
    replays the two batches Keras peeked at, then reads on where the last stopped (``validation_steps`` in all,
    or to the generator's end), as Keras' JAX and torch backends read it (TensorFlow's prefetch may skip a
    batch between passes). Workers deal each pass's batches as a PyDataset's; passes must be alike."""
    what, steps = "validation_data", fit.validation_steps
    check_count("validation_steps", steps)
    draw = GeneratorReader(fit.validation_data, what, "validation_steps").draw
    peeked = draw(KERAS_PEEKS)
    if not peeked:
        raise NbdistError(f"{what} is a generator that yields no batches; it needs at least one.")
    passes = []
    for _ in range(max(1, validations(fit))):
        replayed = peeked[:steps] if steps is not None else list(peeked)
        passes.append(replayed + draw(None if steps is None else steps - len(replayed)))
    if any(len(p) != len(passes[0]) for p in passes):
        lengths = ", ".join(str(len(p)) for p in passes[:6]) + (", ..." if len(passes) > 6 else "")
        raise NbdistError(f"{what} is a generator that ends, so Keras would validate on fewer batches from some "
                          f"epoch on (batches per validation: {lengths}; it replays the {len(peeked)} it peeked at), "
                          "which nbdist cannot split alike over the workers; pass validation_steps and a generator "
                          "that repeats, or the validation arrays.")
    if any(len(b) < 2 for p in passes for b in p):
        raise NbdistError(f"{what} is a generator whose batches hold no labels; yield (x, y) batches.")
    log.info("read %d validation passes of %d batches from a generator", len(passes), len(passes[0]))
    return make_py_dataset_data(ValidationPasses(passes), what)


def reads_once(fit: FitCall) -> bool:
    """Whether the fit's x or validation_data is an input this module reads once (``fit_from_pipelines``)."""
    return (is_pipeline(fit.x) or is_generator(fit.x) or is_pipeline(fit.validation_data)
            or is_generator(fit.validation_data))


def fit_from_pipelines(fit: FitCall) -> FitCall:
    """``model.fit``'s arguments with its tf.data pipelines (x, validation_data) as the arrays they yield,
    and the batch size and shuffling they had."""
    x, vd = fit.x, fit.validation_data
    if not reads_once(fit):
        return fit
    out = fit
    if is_pipeline(x) or is_generator(x):
        kind, whose = ("a generator", "generator's") if is_generator(x) else ("an input pipeline", "pipeline's")
        # A pipeline's own refusals come first; a generator is drawn from only once nothing else refuses.
        rows = None if is_generator(x) else read_any(x, "the training data x")
        for name in ("y", "sample_weight"):
            if getattr(fit, name) is not None:
                raise NbdistError(f"model.fit got {kind} as x and {name} too; drop {name}: the {whose} batches "
                                  "hold the labels and weights, (x, y) or (x, y, sample_weight).")
        if rows is None:
            rows = read_generator(fit)
        if rows.y is None:
            raise NbdistError(f"the training data x is {kind} whose batches hold no labels; yield (x, y) batches "
                              "to train on it.")
        out = out.replace(x=rows.x, y=rows.y, sample_weight=rows.sample_weight, batch_size=rows.batch_size,
                          shuffle=rows.shuffled)
        log.info("read %s into %d rows, batch %d, %s", kind, len(leaves(rows.x)[0]), rows.batch_size,
                 "shuffled each epoch" if rows.shuffled else "in order")
    if is_pipeline(vd):
        val = read_any(vd, "validation_data")
        if val.y is None:
            raise NbdistError("validation_data is an input pipeline whose batches hold no labels; yield (x, y).")
        out = out.replace(validation_data=tuple(p for p in (val.x, val.y, val.sample_weight) if p is not None))
    elif is_generator(vd):
        out = out.replace(validation_data=generator_validation(fit))
    return out


def inference_rows(x: Any, y: Any, sample_weight: Any, what: str) -> tuple[Any, Any, Any]:
    """evaluate's / predict's x, y and weights when x is an input pipeline (its batches hold y)."""
    if not is_pipeline(x):
        return x, y, sample_weight
    rows = read_any(x, f"the {what}")
    if y is not None or sample_weight is not None:
        raise NbdistError(f"the {what} is an input pipeline and y or sample_weight was given too; drop them: the "
                          "pipeline's batches hold the labels and weights, as in model.evaluate(ds).")
    return rows.x, rows.y, rows.sample_weight

