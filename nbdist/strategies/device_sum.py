"""Gradients summed where they are: torch tensors into a few flat buckets on their own device, each bucket
all-reduced by torch.distributed (NCCL for CUDA tensors, Gloo for CPU ones), never through numpy.

The same code runs on the GPU and, in the tests, on CPU tensors over Gloo, so what the CPU proves (weighting,
bucketing, None gradients, dtypes, the rows check, pad steps) is what the GPU runs. Invariant: the summed rows
equal the step's total (checked every step on a CPU, every ``CHECK_EVERY`` on a GPU).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

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


def aligned_slots(sizes: Sequence[int], align: int) -> list[int]:
    """Each gradient's room in a bucket when every gradient must start on a multiple of ``align`` elements
    (TensorFlow adopts only 64-byte aligned memory: ``tf_device_sum.py``)."""
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


def fill(bucket: Any, members: Sequence[int], sizes: Sequence[int], grads: Sequence[Any],
         slots: Sequence[int] | None = None) -> int:
    """Bucket ``bucket`` filled with its members' gradients, flat and in order (zeros for a None gradient);
    returns the elements filled (the rows slot, in the last bucket, comes after them). Under no_grad.
    ``slots``: each gradient's room in the bucket where it is padded past its size (``aligned_slots``)."""
    at = 0
    for i in members:
        size, g = sizes[i], grads[i]
        part = bucket[at:at + size]
        if g is None:
            part.zero_()
        else:
            part.copy_(g.detach().reshape(-1))  # casts to float32 and moves, in one copy
        at += size if slots is None else slots[i]
    return at


def unpack(plan: Sequence[Sequence[int]], buckets: Sequence[Any], sizes: Sequence[int],
           shapes: Sequence[tuple[int, ...]], grads: Sequence[Any], out: list[Any],
           slots: Sequence[int] | None = None) -> None:
    """The summed gradients as views of their buckets, in each gradient's own dtype and device (a None
    gradient stays None); ``slots`` as in ``fill``."""
    for members, bucket in zip(plan, buckets):
        at = 0
        for i in members:
            g, size = grads[i], sizes[i]
            if g is not None:
                view = bucket[at:at + size].view(shapes[i])
                out[i] = view if view.dtype == g.dtype and view.device == g.device else view.to(
                    device=g.device, dtype=g.dtype)
            at += size if slots is None else slots[i]


class TorchDeviceSum:
    """sum_w (n_w / total) g_w over the workers, on the gradients' device (``owner``: HostGradientAllreduce).

    Buckets of ``BUCKET_BYTES`` (PyTorch DDP's default size): each bucket's all-reduce starts, asynchronously,
    as soon as it is filled, while the next is being filled. This is the sum at ``apply``, after the backward pass;
    by default the buckets start during it instead (torch_overlap.py), and this path stays for the cases that
    cannot be overlapped soundly and for a step summed again. They are preallocated once and reused every step
    (the optimizer has consumed last step's sums before the next backward pass writes new gradients: stream
    order on the GPU, program order on the CPU). The last bucket carries this worker's rows in its last slot:
    the summed rows must equal the step's total, as the host exchange checks. On a GPU that check reads the
    device, which waits for the step: it runs every ``CHECK_EVERY`` steps (a mismatch is kept on the device
    meanwhile) rather than stall every step.
    """

    def __init__(self, shapes: Sequence[tuple[int, ...]], device: Any, group: Any = None,
                 bucket_bytes: int = BUCKET_BYTES, check_every: int | None = None, align: int = 1) -> None:
        """``align``: every gradient starts on a multiple of this many elements of its bucket (1: packed)."""
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.device = torch.device(device)
        self.group = group  # None: the default process group
        self.shapes = [tuple(s) for s in shapes]
        self.sizes = [int(torch.Size(s).numel()) for s in self.shapes]
        self.slots = None if align == 1 else aligned_slots(self.sizes, align)
        room = self.sizes if self.slots is None else self.slots
        self.plan = bucket_plan(room, max(1, bucket_bytes // 4))
        lengths = [sum(room[i] for i in b) for b in self.plan]
        lengths[-1] += 1  # this worker's rows
        self.buckets = [torch.zeros(n, dtype=torch.float32, device=self.device) for n in lengths]
        self.check_every = check_every or check_every_for(self.device.type)
        self.rows = RowsCheck(self.device, self.check_every)

    def zeros(self, shapes: Sequence[tuple[int, ...]], present: Sequence[bool]) -> list[Any]:
        """A pad step's gradients: zeros on the device (None where no gradient comes)."""
        return [self._torch.zeros(s, dtype=self._torch.float32, device=self.device) if p else None
                for s, p in zip(shapes, present)]

    def reduce(self, owner: Any, grads: list[Any]) -> list[Any]:
        torch = self._torch
        t0 = time.perf_counter()
        n, total = owner.weight, owner._check_total()
        scale = n / total
        out: list[Any] = [None] * len(grads)
        pending = []
        with torch.no_grad():
            for k, (members, bucket) in enumerate(zip(self.plan, self.buckets)):
                at = fill(bucket, members, self.sizes, grads, self.slots)
                if k == len(self.plan) - 1:
                    bucket[-1] = n
                bucket[:at].mul_(scale)
                pending.append(self._dist.all_reduce(bucket, op=self._dist.ReduceOp.SUM, group=self.group,
                                                     async_op=True))
            for work in pending:
                work.wait()  # on a GPU: the compute stream waits for the sum, the host does not
            self.rows.add(self.buckets[-1][-1], total)
            unpack(self.plan, self.buckets, self.sizes, self.shapes, grads, out, self.slots)
        owner.seconds += time.perf_counter() - t0
        owner.steps += 1
        return out

    def check(self, total: float | None = None) -> None:
        """Raise if any step since the last check summed rows other than its total (reads the device)."""
        self.rows.check(total)


class TorchDeviceAverage:
    """One parameter-averaging round on the variables' own device: sum_w n_w v_w / sum_w n_w, the variables
    copied into the buckets, all-reduced, and the average copied back in place (``WeightedAverager``'s
    round without the host: the averaging strategy's engine on torch when every worker has a GPU of its
    own). Keras' torch variables hold a torch tensor (``v.value``), written under ``no_grad``. ``_read``,
    ``_ready`` and ``_write`` are where another framework's variables come in (``tf_device_sum.py``)."""

    def __init__(self, variables: Sequence[Any], device: Any, group: Any = None,
                 bucket_bytes: int = BUCKET_BYTES, align: int = 1) -> None:
        """``align``: every variable starts on a multiple of this many elements of its bucket (1: packed)."""
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.variables = list(variables)
        self.device = torch.device(device)
        self.group = group
        self.shapes = [tuple(int(d) for d in v.shape) for v in self.variables]
        self.sizes = [int(torch.Size(s).numel()) for s in self.shapes]
        self.slots = None if align == 1 else aligned_slots(self.sizes, align)
        room = self.sizes if self.slots is None else self.slots
        self.plan = bucket_plan(room, max(1, bucket_bytes // 4)) or [[]]
        lengths = [sum(room[i] for i in b) for b in self.plan]
        lengths[-1] += 1  # this worker's samples
        self.buckets = [torch.zeros(n, dtype=torch.float32, device=self.device) for n in lengths]
        self.seconds = 0.0
        self.rounds = 0

    @property
    def summed_by(self) -> str:
        return "device"

    def _read(self, i: int) -> Any:
        """Variable ``i``'s value as a torch tensor (not copied)."""
        return self.variables[i].value.detach()

    def _ready(self) -> None:
        """Called after every variable was read, before the buckets are filled."""

    def _write(self, i: int, summed: Any, total: float) -> None:
        """Variable ``i`` set to ``summed`` (its flat slice of a bucket) divided by ``total``."""
        v = self.variables[i]
        v.value.copy_(summed.view(self.shapes[i]) / total)

    def average(self, samples: int) -> int:
        torch = self._torch
        t0 = time.perf_counter()
        pending = []
        with torch.no_grad():
            values = [self._read(i) for i in range(len(self.variables))]
            self._ready()
            for k, (members, bucket) in enumerate(zip(self.plan, self.buckets)):
                if samples:
                    at = fill(bucket, members, self.sizes, values, self.slots)
                    bucket[:at].mul_(float(samples))
                else:  # a pad round: none of this worker's values, as in the host's round
                    bucket.zero_()
                if k == len(self.plan) - 1:
                    bucket[-1] = float(samples)
                pending.append(self._dist.all_reduce(bucket, op=self._dist.ReduceOp.SUM, group=self.group,
                                                     async_op=True))
            for work in pending:
                work.wait()
            total = float(self.buckets[-1][-1])  # one read of the device per round: the host waits for the sums
            del values  # read until now (on a GPU, by torch's stream)
            if total > 0:
                for members, bucket in zip(self.plan, self.buckets):
                    at = 0
                    for i in members:
                        self._write(i, bucket[at:at + self.sizes[i]], total)
                        at += self.sizes[i] if self.slots is None else self.slots[i]
        self.seconds += time.perf_counter() - t0
        self.rounds += 1
        return int(round(total))

    def close(self) -> None:
        pass


def engine_device(engine: str) -> Any:
    """The buckets' device: the worker's one GPU for "nccl" (CUDA_VISIBLE_DEVICES per rank: its device 0, also
    TensorFlow's GPU:0), else the CPU."""
    import torch

    if engine != "nccl":
        return torch.device("cpu")
    torch.cuda.set_device(0)
    return torch.device("cuda", 0)


def device_group(backend: str, timeout: float | None = None) -> Any:
    """A process group for the device sum beside nbdist's own Gloo group, on the same store (every worker
    calls this: each chose the same engine from the same flags). ``timeout``: nbdist's sync timeout in seconds,
    the bound of each of its collectives (torch's own default would be 10 minutes for NCCL, 30 for Gloo)."""
    import datetime

    import torch.distributed as dist

    return dist.new_group(backend=backend, timeout=datetime.timedelta(seconds=timeout) if timeout else None)
