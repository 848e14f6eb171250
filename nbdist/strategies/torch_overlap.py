"""The torch device sum's buckets overlapped with the backward pass (PyTorch DDP's design).

A post-accumulate-grad hook on each trainable tensor marks its gradient final; buckets, planned in the order
backward produces gradients, start in bucket order as they fill, so every worker calls the same collectives in
the same order. Invariant: the sums equal ``TorchDeviceSum``'s at ``apply``; any worker that saw a gradient its
buckets may not hold (agreed by one MAX per step on a Gloo group of its own) makes all sum the step again.
Refused (``overlap_refusal``): one bucket, ``overlap=False``, a model's own ``train_step``, ``jit_compile``.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from .device_sum import backward_plan

__all__ = ["BucketReadiness", "TorchOverlap", "backward_plan", "overlap_refusal"]
log = logging.getLogger(__name__)


class BucketReadiness:
    """Which buckets may start after which gradients: pure bookkeeping, one step at a time.

    ``arrive(i)`` for each gradient the backward pass finishes returns the buckets to launch now, in bucket
    order: a bucket is launched once all its gradients arrived and every bucket before it was launched. The
    last bucket is never launched early (``apply`` launches it with the rows). A gradient that
    arrives twice in a step marks the step ``repeated``.
    """

    def __init__(self, plan: Sequence[Sequence[int]]) -> None:
        self.plan = [list(b) for b in plan]
        self.bucket_of = {i: k for k, members in enumerate(self.plan) for i in members}
        self.early = max(0, len(self.plan) - 1)  # buckets that may start before apply
        self.start_step()

    def start_step(self) -> None:
        self.arrivals = dict.fromkeys(self.bucket_of, 0)
        self.missing = [len(members) for members in self.plan]
        self.launched = 0  # buckets 0 .. launched-1 have started
        self.repeated = False

    def arrive(self, i: int) -> list[int]:
        self.arrivals[i] += 1
        if self.arrivals[i] > 1:
            self.repeated = True
            return []
        self.missing[self.bucket_of[i]] -= 1
        start = self.launched
        while self.launched < self.early and self.missing[self.launched] == 0:
            self.launched += 1
        return list(range(start, self.launched))

    def rest(self) -> list[int]:
        """The buckets ``apply`` launches: those not started during the backward pass, the last one always."""
        return list(range(self.launched, len(self.plan)))

    def early_members(self) -> list[int]:
        return [i for k in range(self.launched) for i in self.plan[k]]


def overlap_refusal(model: Any, tensors: Sequence[Any], buckets: int) -> str | None:
    """Why the buckets cannot start during the backward pass (None: they can)."""
    import torch
    from keras.src.backend.torch.trainer import TorchTrainer

    if buckets < 2:
        return "one bucket: nothing to overlap"
    if not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        return f"torch {torch.__version__} has no post-accumulate-grad hooks (2.1 or later)"
    if getattr(type(model), "train_step", None) is not TorchTrainer.train_step:
        return "the model has its own train_step"
    if getattr(model, "jit_compile", False) is True:
        return "jit_compile=True"
    if not all(isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad for t in tensors):
        return "a trainable variable's tensor is not a leaf that requires grad"
    return None


class TorchOverlap:
    """The device sum ``summer`` (TorchDeviceSum, its buckets planned in backward order: ``backward_plan``)
    started by hooks on ``tensors`` (the trainable variables' torch tensors, in ``owner.shapes``' order).
    ``flag_group``: the Gloo group the flag is agreed on (default: a new one on the same ranks; every worker
    makes its ``TorchOverlap`` at the same point, as ``new_group`` needs).

    The flag (this worker's early buckets may not hold the gradients ``apply`` got: a gradient that arrived twice,
    a gradient tensor at ``apply`` other than the one the hook copied, or one that came early and is None at
    ``apply``) is agreed on the host, never over the sum's group: a worker may launch a bucket early that another
    launches at ``apply``, and the flag would pair with a bucket. At ``apply`` the buckets not yet launched (a
    variable without a gradient, a pad step's zeros, hooks that fired before the step's rows were set) are filled
    from the gradients ``apply`` got; a flagged step is summed again by ``summer`` from them. No step reads the
    device for the flag: the rows are checked as ``TorchDeviceSum`` checks them, so the host runs ahead of the GPU
    as it does without the overlap. Unchanged by it: mixed precision's loss scale (the hook copies ``.grad``, the
    scaled gradient ``apply`` gets), ``gradient_accumulation_steps`` (accumulated inside ``apply``, after the
    sum). The hooks go at ``close``.
    """

    def __init__(self, summer: Any, tensors: Sequence[Any], owner: Any, flag_group: Any = None) -> None:
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        self.summer, self.owner = summer, owner
        self.plan, self.rows = summer.plan, summer.rows
        self.ready = BucketReadiness(self.plan)
        self.flag_group = dist.new_group(backend="gloo") if flag_group is None else flag_group
        self._flag = torch.zeros(1, dtype=torch.int32)  # on the host: 1 where this worker's early buckets may be wrong
        self._seen: list[Any] = [None] * len(summer.sizes)  # the gradient tensor each hook copied from
        self._pending: list[Any] = []
        self.events: list[tuple[str, int]] | None = None  # a list: ("grad", i) and ("launch", k) recorded (tests)
        self.early_launches = 0  # buckets started during a backward pass, over the run
        self.resummed = 0  # steps summed again (a flag was set)
        self._handles = [t.register_post_accumulate_grad_hook(self._hook(i)) for i, t in enumerate(tensors)]

    def _hook(self, i: int) -> Callable[[Any], None]:
        def ready(tensor: Any) -> None:
            queued = self.owner._queued  # the step's (rows, total rows), set before the step
            if not self._handles or not queued or not queued[0][1]:
                return  # not inside a step: apply fills the bucket from its gradients
            if self.events is not None:
                self.events.append(("grad", i))
            self._seen[i] = tensor.grad
            for k in self.ready.arrive(i):
                self._launch(k, self._seen, *queued[0])
        return ready

    def _launch(self, k: int, grads: Sequence[Any], n: float, total: float) -> None:
        """Bucket ``k`` filled with ``grads`` weighted by n / total (as TorchDeviceSum), its all-reduce started."""
        with self._torch.no_grad():
            self._pending.append(self.summer.launch(k, grads, n / total, n))
        if self.events is not None:
            self.events.append(("launch", k))

    def reduce(self, owner: Any, grads: list[Any]) -> list[Any]:
        """At ``apply`` (the step's rows taken by ``owner``): the rest of the buckets, then every sum awaited."""
        torch = self._torch
        t0 = time.perf_counter()
        n, total = owner.weight, owner._check_total()
        early = self.ready.launched
        sound = not self.ready.repeated and all(
            self._seen[i] is not None and self._seen[i] is grads[i] for i in self.ready.early_members())
        self._flag[0] = 0 if sound else 1
        try:
            agreed = self._dist.all_reduce(self._flag, op=self._dist.ReduceOp.MAX, group=self.flag_group,
                                           async_op=True)  # host memory, Gloo: no wait for the device
            for k in self.ready.rest():
                self._launch(k, grads, n, total)
            pending, self._pending = self._pending + [agreed], []
            for work in pending:
                work.wait()  # on a GPU: the compute stream waits for the sums, the host does not
        finally:
            self.ready.start_step()
            self._seen = [None] * len(self._seen)
        if int(self._flag[0]):
            self.resummed += 1
            log.info("a worker's gradients changed after the backward pass: this step is summed again")
            owner.seconds += time.perf_counter() - t0
            return self.summer.reduce(owner, grads)
        with torch.no_grad():
            self.rows.add(self.summer.count(), total)  # read every step on a CPU, every 50 on a GPU
            out = self.summer.unpack(grads)
        self.early_launches += early
        owner.seconds += time.perf_counter() - t0
        owner.steps += 1
        return out

    def close(self) -> None:
        """Remove the hooks (the model's tensors keep none, nor a reference to the group)."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._pending, self._seen = [], []
        self.summer = self.owner = self.flag_group = None
