"""The device engine: tensors summed where they are, in a few flat torch buckets on their own device, each bucket
all-reduced by torch.distributed (NCCL for CUDA tensors, Gloo for CPU ones), never through numpy.

One engine for every framework: only how a tensor comes in and goes back is the framework's (``TorchTensors``
as they are, ``TFTensors`` by DLPack). The same code runs on the GPU and, in the tests, on CPU tensors over Gloo
(device_sum="always"), so what the CPU proves (weighting, bucketing, None gradients, dtypes, the rows check, pad
steps) is what the GPU runs. Invariant: the summed rows equal the step's total (checked every step on a CPU,
every ``CHECK_EVERY`` on a GPU); an averaging round divides by the summed samples.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from .averaging import Averager

BUCKET_BYTES = 25 * 2**20
CHECK_EVERY = 50


def bucket_plan(sizes: Sequence[int], limit_elements: int) -> list[list[int]]:
    """Consecutive gradients grouped into buckets of at most ``limit_elements`` (a larger gradient alone)."""
    buckets: list[list[int]] = []
    filled = limit_elements
    for i, size in enumerate(sizes):
        if not buckets or filled + size > limit_elements:
            buckets.append([])
            filled = 0
        buckets[-1].append(i)
        filled += size
    return buckets


def backward_plan(sizes: Sequence[int], limit_elements: int) -> list[list[int]]:
    """Buckets of variable indices in the order the backward pass produces them: the variables reversed, then
    consecutive ones grouped into buckets of at most ``limit_elements`` (a larger one alone)."""
    order = list(range(len(sizes)))[::-1]
    return [[order[j] for j in bucket] for bucket in bucket_plan([sizes[i] for i in order], limit_elements)]


def aligned_slots(sizes: Sequence[int], align: int) -> list[int]:
    """Each gradient's room in a bucket when every gradient must start on a multiple of ``align`` elements
    (TensorFlow adopts only 64-byte aligned memory: ``TFTensors``)."""
    return [-(-size // align) * align for size in sizes]


def check_every_for(device_type: str) -> int:
    """Steps between reads of the summed rows: every step on a CPU (reading it costs nothing), every
    ``CHECK_EVERY`` elsewhere (a read waits for the device to finish the step)."""
    return 1 if device_type == "cpu" else CHECK_EVERY


class RowsCheck:
    """The summed rows against each step's total, kept on the device and read every ``every`` steps: a
    mismatch accumulates there meanwhile (``reads`` counts the reads of the device, for tests)."""

    def __init__(self, device: Any, every: int) -> None:
        import torch

        self.every = every
        self._mismatch = torch.zeros((), dtype=torch.float32, device=device)
        self._unchecked = 0
        self._summed: Any = None
        self.reads = 0

    def add(self, summed: Any, total: float) -> None:
        """``summed``: the step's summed rows, a one-element tensor on the device (not read here)."""
        self._mismatch += (summed - total).abs()
        self._summed = summed
        self._unchecked += 1
        if self._unchecked >= self.every:
            self.check(total)

    def check(self, total: float | None = None) -> None:
        """Raise if any step since the last check summed rows other than its total (reads the device)."""
        self._unchecked = 0
        self.reads += 1
        if float(self._mismatch) != 0.0:
            summed = float(self._summed)
            self._mismatch.zero_()
            said = f"{summed:g} summed" + (f", {total:g} expected" if total is not None else "")
            raise RuntimeError(f"workers disagree on this step's samples: {said}")


class TorchTensors:
    """How Keras' torch tensors go into the buckets and come back: as they are."""

    align = 1  # elements: a bucket's members packed

    def read(self, tensor: Any) -> Any:
        """``tensor`` (a gradient, or a variable's value) as a torch tensor, not copied."""
        return tensor

    def wait(self, tensors: Sequence[Any]) -> None:
        """Before the buckets are filled from ``tensors``: the framework has written them."""

    def done(self) -> None:
        """After the sums, before the framework reads them."""

    def back(self, summed: Any) -> Any:
        """A summed gradient (a view of its bucket) as the framework's tensor."""
        return summed

    def assign(self, variable: Any, summed: Any, shape: tuple[int, ...], total: float) -> None:
        """``variable`` set to ``summed`` (its flat slice of a bucket) divided by ``total``."""
        variable.value.copy_(summed.view(shape) / total)


class TFTensors(TorchTensors):
    """TensorFlow's tensors by DLPack, both ways without a copy. TensorFlow adopts only 64-byte aligned memory (an
    unaligned DLPack tensor aborts the process), so each starts on 16 floats of its bucket. A DLPack capsule carries
    no stream (NOT RUN ON A GPU): the host waits for the whole device (TensorFlow's stream too) before the buckets
    are filled, and for torch's stream before TensorFlow reads the sums. A variable assigned a bucket's slice would
    live in the bucket (TensorFlow's assign adopts it): the division is TensorFlow's, and its result is assigned."""

    align = 16

    def __init__(self, cuda: bool) -> None:
        import tensorflow as tf
        import torch
        from torch.utils import dlpack

        self.cuda, self._tf, self._torch, self._dlpack = cuda, tf, torch, dlpack

    def read(self, tensor: Any) -> Any:
        tf = self._tf
        return self._dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(tf.convert_to_tensor(tensor)))

    def wait(self, tensors: Sequence[Any]) -> None:
        # Also where the buckets are on the CPU (Gloo) and a variable on a GPU: torch's copy would not wait for it.
        if self.cuda or any(t is not None and t.is_cuda for t in tensors):
            self._torch.cuda.synchronize()

    def done(self) -> None:
        if self.cuda:
            self._torch.cuda.current_stream().synchronize()

    def back(self, summed: Any) -> Any:
        return self._tf.experimental.dlpack.from_dlpack(self._dlpack.to_dlpack(summed))

    def assign(self, variable: Any, summed: Any, shape: tuple[int, ...], total: float) -> None:
        tf = self._tf
        variable.assign(tf.cast(tf.reshape(self.back(summed), shape) / total, variable.dtype))


class DeviceBuckets:
    """Tensors of fixed shapes in a few flat float32 buckets on one device (of at most ``bucket_bytes``, PyTorch
    DDP's default size), preallocated once and all-reduced by torch.distributed over ``group`` (None: the default
    one). The last bucket's last slot carries a count (a step's rows, a round's samples). ``tensors``: how the
    framework's tensors come in and go back (``TorchTensors``, ``TFTensors``)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], device: Any, group: Any = None,
                 bucket_bytes: int = BUCKET_BYTES, tensors: TorchTensors | None = None,
                 planner: Callable[[Sequence[int], int], list[list[int]]] = bucket_plan) -> None:
        """``planner``: which members go in which bucket (``bucket_plan``: in order; torch_overlap.py: backward's)."""
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.tensors = tensors or TorchTensors()
        self.device = torch.device(device)
        self.group = group
        self.shapes = [tuple(int(d) for d in s) for s in shapes]
        self.sizes = [int(torch.Size(s).numel()) for s in self.shapes]
        align = self.tensors.align
        self.slots = None if align == 1 else aligned_slots(self.sizes, align)
        room = self.sizes if self.slots is None else self.slots
        self.plan = planner(room, max(1, bucket_bytes // 4)) or [[]]
        lengths = [sum(room[i] for i in b) for b in self.plan]
        lengths[-1] += 1  # the count
        self.buckets = [torch.zeros(n, dtype=torch.float32, device=self.device) for n in lengths]
        if any(b.data_ptr() % (4 * align) for b in self.buckets):
            raise RuntimeError(f"torch allocated a bucket that is not {4 * align}-byte aligned")

    def parts(self, k: int | None = None) -> Iterator[tuple[int, Any]]:
        """(member, its flat slice of its bucket) for bucket ``k``'s members, or every bucket's."""
        for members, bucket in zip(self.plan, self.buckets) if k is None else [(self.plan[k], self.buckets[k])]:
            at = 0
            for i in members:
                yield i, bucket[at:at + self.sizes[i]]
                at += self.sizes[i] if self.slots is None else self.slots[i]

    def launch(self, k: int, tensors: Sequence[Any], scale: float, count: float) -> Any:
        """Bucket ``k`` filled with its members of ``tensors`` (zeros for a None), flat, times ``scale`` (zeros where
        ``scale`` is 0: a pad, none of this worker's values), ``count`` in the last bucket's last slot, and its
        all-reduce started. Under no_grad."""
        bucket = self.buckets[k]
        if scale:
            for i, part in self.parts(k):
                if tensors[i] is None:
                    part.zero_()
                else:
                    part.copy_(tensors[i].detach().reshape(-1))  # casts to float32 and moves, in one copy
            bucket.mul_(scale)
        else:
            bucket.zero_()
        if k == len(self.plan) - 1:
            bucket[-1] = count
        return self._dist.all_reduce(bucket, op=self._dist.ReduceOp.SUM, group=self.group, async_op=True)

    def all_reduce(self, tensors: Sequence[Any], scale: float, count: float) -> None:
        """Every bucket launched (``launch``) as soon as it is filled, while the next is being filled; returns once
        summed (on a GPU: the compute stream waits for the sums, the host does not)."""
        for work in [self.launch(k, tensors, scale, count) for k in range(len(self.plan))]:
            work.wait()

    def count(self) -> Any:
        """The summed count: a one-element tensor on the device (not read here)."""
        return self.buckets[-1][-1]

    def unpack(self, grads: Sequence[Any]) -> list[Any]:
        """The summed tensors as views of their buckets, in each one's own dtype and device (None stays None)."""
        out: list[Any] = [None] * len(grads)
        for i, part in self.parts():
            g = grads[i]
            if g is not None:
                view = part.view(self.shapes[i])
                out[i] = view if view.dtype == g.dtype and view.device == g.device else view.to(
                    device=g.device, dtype=g.dtype)
        return out


class TorchDeviceSum(DeviceBuckets):
    """sum_w (n_w / total) g_w over the workers, on the gradients' device (``owner``: the hook, which sets
    ``weight`` and ``total`` and counts ``seconds`` and ``steps``): the sum at ``apply``, after the backward pass
    (torch_overlap.py starts the buckets during it where that is sound). The buckets are reused every step: the
    optimizer has consumed last step's sums before the next backward pass writes new gradients (stream order on the
    GPU, program order on the CPU). The summed rows must equal the step's total: on a GPU that check reads the
    device, so it runs every ``CHECK_EVERY`` steps (a mismatch is kept on the device meanwhile).
    ``kept``: the gradients the framework may keep past the step (TensorFlow's ``overwrite_with_gradient``),
    handed back as copies, since their bucket is refilled next step."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], device: Any, group: Any = None,
                 bucket_bytes: int = BUCKET_BYTES, check_every: int | None = None,
                 tensors: TorchTensors | None = None, kept: Sequence[bool] | None = None,
                 planner: Callable[[Sequence[int], int], list[list[int]]] = bucket_plan) -> None:
        super().__init__(shapes, device, group, bucket_bytes, tensors, planner)
        self.check_every = check_every or check_every_for(self.device.type)
        self.rows = RowsCheck(self.device, self.check_every)
        self.kept = list(kept) if kept is not None and any(kept) else None

    def zeros(self, shapes: Sequence[tuple[int, ...]], present: Sequence[bool]) -> list[Any]:
        """A pad step's gradients: zeros on the device (None where no gradient comes)."""
        return [self._torch.zeros(s, dtype=self._torch.float32, device=self.device) if p else None
                for s, p in zip(shapes, present)]

    def reduce(self, owner: Any, grads: Sequence[Any]) -> list[Any]:
        """The summed gradients, as the framework's tensors (None stays None)."""
        t0 = time.perf_counter()
        n, total = owner.weight, owner._check_total()
        io = self.tensors
        grads = [None if g is None else io.read(g) for g in grads]
        io.wait(grads)
        with self._torch.no_grad():
            self.all_reduce(grads, n / total, n)
            self.rows.add(self.count(), total)
            out = self.unpack(grads)
            if self.kept is not None:
                out = [o.clone() if keep and o is not None else o for o, keep in zip(out, self.kept)]
        io.done()
        owner.seconds += time.perf_counter() - t0
        owner.steps += 1
        return [None if o is None else io.back(o) for o in out]

    def check(self, total: float | None = None) -> None:
        """Raise if any step since the last check summed rows other than its total (reads the device)."""
        self.rows.check(total)


class TorchDeviceAverage(DeviceBuckets, Averager):
    """One averaging round on the variables' own device: sum_w n_w v_w / sum_w n_w, the variables copied into the
    buckets, all-reduced, and the average written back (``tensors.assign``). One read of the device per round (the
    summed samples, to divide by); the values read from the variables are dropped only after it."""

    def __init__(self, variables: Sequence[Any], device: Any, group: Any = None,
                 bucket_bytes: int = BUCKET_BYTES, tensors: TorchTensors | None = None) -> None:
        self.variables = list(variables)
        super().__init__([tuple(v.shape) for v in self.variables], device, group, bucket_bytes, tensors)

    def _round(self, samples: int) -> int:
        io = self.tensors
        with self._torch.no_grad():
            values = [io.read(v.value) for v in self.variables]
            io.wait(values)
            self.all_reduce(values, float(samples), float(samples))
            total = float(self.count())  # the host waits for the sums
            del values  # read until now (on a GPU, by torch's stream)
            for i, part in self.parts() if total > 0 else ():
                io.assign(self.variables[i], part, self.shapes[i], total)
        return int(round(total))


def device_parts(engine: str, timeout: float | None, backend: str) -> tuple[Any, Any, TorchTensors]:
    """The plan's device sum's (device, process group, tensors): "nccl" the worker's one GPU (CUDA_VISIBLE_DEVICES
    per rank: its device 0, also TensorFlow's GPU:0), else the CPU; a group of its own beside nbdist's Gloo group,
    on the same store (every worker calls this at the same point), each collective bounded by nbdist's sync
    ``timeout`` (torch's own: 10 minutes for NCCL, 30 for Gloo); Keras' ``backend``'s tensors (``TFTensors``)."""
    import datetime

    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if engine == "nccl":
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    group = dist.new_group(backend=engine, timeout=datetime.timedelta(seconds=timeout) if timeout else None)
    return device, group, TFTensors(engine == "nccl") if backend == "tensorflow" else TorchTensors()


def open_device_sum(shapes: Sequence[tuple[int, ...]], engine: str, bucket_bytes: int, timeout: float | None,
                    backend: str, kept: Sequence[bool] | None = None) -> TorchDeviceSum:
    """The plan's device sum (``device_parts``); ``kept`` as ``TorchDeviceSum`` has it (TensorFlow only: torch's
    assign copies); on torch, buckets in backward order (torch_overlap.py may start them during it)."""
    device, group, tensors = device_parts(engine, timeout, backend)
    return TorchDeviceSum(shapes, device, group, bucket_bytes, tensors=tensors,
                          kept=kept if backend == "tensorflow" else None,
                          planner=backward_plan if backend == "torch" else bucket_plan)


def open_device_average(variables: Sequence[Any], engine: str, bucket_bytes: int, timeout: float | None,
                        backend: str) -> TorchDeviceAverage:
    """The plan's averaging rounds on the device, as ``open_device_sum``."""
    device, group, tensors = device_parts(engine, timeout, backend)
    return TorchDeviceAverage(variables, device, group, bucket_bytes, tensors)
