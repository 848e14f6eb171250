"""The torch device sum's buckets started during the backward pass (strategies/torch_overlap.py).

The bookkeeping is pure logic (which bucket may start after which gradients, in backward order). The hooks run
on a real torch model's backward pass over a one-rank Gloo group (a one-rank sum is the identity, so the
overlapped step must hand back exactly what the buckets-at-apply step does): the first bucket starts before
the backward pass's last gradient, a second backward before ``apply`` makes the step summed again, a variable
without a gradient keeps None, and no hook is left after ``close``. The flag is agreed on the host: at a GPU's
rows-check cadence no step reads the device, and another worker's flag (simulated: one rank) re-sums the step
here too. Two workers: tests/workers/test_backends.py.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist

from nbdist.strategies.backend_grads import HostGradientAllreduce
from nbdist.strategies.collective import SoloCollective
from nbdist.strategies.device_sum import CHECK_EVERY, TorchDeviceSum, check_every_for
from nbdist.strategies.torch_overlap import BucketReadiness, TorchOverlap, backward_plan

BUCKET_BYTES = 400  # 100 floats: this model's 6 tensors in 4 buckets


def test_buckets_are_planned_in_backward_order():
    assert backward_plan([6, 3, 4, 2], 7) == [[3, 2], [1], [0]]
    assert backward_plan([6, 3, 4, 2], 100) == [[3, 2, 1, 0]]
    assert backward_plan([], 7) == []


def test_a_bucket_starts_once_its_gradients_and_all_buckets_before_it_are_there_the_last_at_apply():
    ready = BucketReadiness([[3, 2], [1], [0]])
    assert ready.arrive(3) == []
    assert ready.arrive(1) == []  # bucket 1 is complete, but bucket 0 has not started: it waits its turn
    assert ready.arrive(2) == [0, 1]
    assert ready.arrive(0) == []  # the last bucket always waits for apply (it carries the rows)
    assert ready.rest() == [2] and ready.early_members() == [3, 2, 1] and not ready.repeated
    assert ready.arrive(3) == [] and ready.repeated  # a second backward in the same step

    ready.start_step()  # variable 2 gets no gradient: its bucket and every later one start at apply
    assert [ready.arrive(i) for i in (3, 1, 0)] == [[], [], []]
    assert ready.rest() == [0, 1, 2] and ready.early_members() == [] and not ready.repeated


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def model(unused: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
              torch.nn.Linear(16, 4)]
    net = torch.nn.Sequential(*layers)
    if unused:  # a branch the forward pass never takes: its gradients stay None
        net.spare = torch.nn.Linear(3, 3)
        net.forward = torch.nn.Sequential(*layers).forward  # type: ignore[method-assign]
    return net


def summer(net: torch.nn.Module, overlap: bool, check_every: int | None = None) -> HostGradientAllreduce:
    """The reducer as a torch worker with its device sum holds it (this process's Keras is not on torch)."""
    params = list(net.parameters())
    owner = HostGradientAllreduce(SoloCollective(), [np.zeros(tuple(p.shape), np.float32) for p in params])
    owner._engine_impl = TorchDeviceSum(owner.shapes, "cpu", bucket_bytes=BUCKET_BYTES, check_every=check_every,
                                        planner=backward_plan)
    if overlap:
        owner._overlap = TorchOverlap(owner._engine_impl, params, owner)
    return owner


def train(net: torch.nn.Module, owner: HostGradientAllreduce, steps: int = 3, backwards: int = 1) -> list[list[float]]:
    """Keras' torch step: rows set, zero_grad, backward, the gradients summed at apply, SGD; the sums handed back."""
    rng = np.random.default_rng(1)
    sums = []
    for _ in range(steps):
        x, y = (torch.from_numpy(rng.normal(size=(5, n)).astype(np.float32)) for n in (8, 4))
        owner.set_weight(5, 5)
        net.zero_grad()
        loss = ((net(x) - y) ** 2).mean()
        for _ in range(backwards):
            loss.backward(retain_graph=True)
        summed = owner.reduce_torch([p.grad for p in net.parameters()])
        sums.append([None if g is None else float(g.abs().sum()) for g in summed])
        with torch.no_grad():
            for p, g in zip(net.parameters(), summed):
                if g is not None:
                    p -= 0.1 * g
    return sums


@pytest.mark.usefixtures("one_rank")
def test_the_first_bucket_starts_before_the_backward_pass_ends_and_the_step_equals_buckets_at_apply():
    net, plain = model(), model()
    owner = summer(net, overlap=True)
    overlap = owner._overlap
    overlap.events = []
    assert train(net, owner) == train(plain, summer(plain, overlap=False))
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), plain.parameters()))
    step = overlap.events[:overlap.events.index(("launch", 3)) + 1]  # the first step's events
    last_grad = max(k for k, e in enumerate(step) if e[0] == "grad")
    assert step.index(("launch", 0)) < last_grad  # started while the backward pass went on
    assert [e for e in step if e[0] == "launch"] == [("launch", k) for k in range(4)]
    assert overlap.early_launches == 3 * 3 and overlap.resummed == 0 and owner.steps == 3


@pytest.mark.usefixtures("one_rank")
def test_a_second_backward_before_apply_sums_the_step_again_with_what_apply_got():
    net, plain = model(), model()
    owner = summer(net, overlap=True)
    assert train(net, owner, backwards=2) == train(plain, summer(plain, overlap=False), backwards=2)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), plain.parameters()))
    assert owner._overlap.resummed == 3


@pytest.mark.usefixtures("one_rank")
def test_a_variable_without_a_gradient_stays_none_and_its_bucket_starts_at_apply():
    net, plain = model(unused=True), model(unused=True)
    owner = summer(net, overlap=True)
    sums = train(net, owner)
    assert sums == train(plain, summer(plain, overlap=False)) and sums[0][-2:] == [None, None]
    assert owner._overlap.plan[0][:2] == [7, 6]  # the unused layer's bias and weight: in the first bucket
    assert owner._overlap.early_launches == 0 and owner._overlap.resummed == 0


@pytest.mark.usefixtures("one_rank")
def test_hooks_fire_only_inside_a_step_and_none_is_left_after_close():
    net = model()
    owner = summer(net, overlap=True)
    overlap = owner._overlap
    overlap.events = []
    net(torch.ones(2, 8)).sum().backward()  # no rows set: not a training step
    assert overlap.events == []
    train(net, owner, steps=1)
    owner.close()
    assert all(not p._post_accumulate_grad_hooks for p in net.parameters())
    assert owner._overlap is None and overlap.summer is None and owner.summed_by == "device-overlapped"



def test_the_rows_are_read_every_step_on_a_cpu_and_every_check_every_steps_on_a_gpu():
    assert check_every_for("cpu") == 1
    assert check_every_for("cuda") == CHECK_EVERY > 1  # pure logic: no GPU here


@pytest.mark.usefixtures("one_rank")
def test_at_a_gpus_cadence_no_step_reads_the_device_and_a_flagged_step_is_still_summed_again():
    """CPU tensors with a CUDA device's rows check (simulated: ``check_every_for("cuda")``, the only part that
    depends on the device): the flag is agreed over a Gloo group of its own on the host, so a step reads the
    device only when the rows check is due, flagged or not; on a CPU's cadence, every step."""
    net, plain = model(), model()
    owner, reference = summer(net, True, check_every_for("cuda")), summer(plain, False, check_every_for("cuda"))
    overlap = owner._overlap
    assert train(net, owner, steps=4) == train(plain, reference, steps=4)
    assert overlap.resummed == 0 and overlap.rows.reads == 0 and owner._engine_impl.rows.reads == 0
    assert train(net, owner, steps=2, backwards=2) == train(plain, reference, steps=2, backwards=2)
    assert overlap.resummed == 2 and overlap.rows.reads == 0 and owner._engine_impl.rows.reads == 0
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), plain.parameters()))
    assert overlap.flag_group is not None and overlap.flag_group is not owner._engine_impl.group

    on_cpu = summer(model(), True)
    train(model(), on_cpu, steps=3)
    assert on_cpu._overlap.rows.reads == 3


class AnotherWorkerFlagged:
    """torch.distributed as this worker sees it when another worker set the flag: the MAX over the flag group
    comes back 1 (simulated on a one-rank group; the real one-rank all-reduce still runs)."""

    def __getattr__(self, name: str) -> object:
        return getattr(dist, name)

    def all_reduce(self, tensor: torch.Tensor, op: object, group: object = None, async_op: bool = False) -> object:
        work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
        if op == dist.ReduceOp.MAX:
            work.wait()
            tensor.fill_(1)
        return work


@pytest.mark.usefixtures("one_rank")
def test_another_workers_flag_sums_the_step_again_here_though_this_workers_buckets_were_sound():
    net, plain = model(), model()
    owner = summer(net, overlap=True)
    owner._overlap._dist = AnotherWorkerFlagged()
    assert train(net, owner) == train(plain, summer(plain, overlap=False))
    assert owner._overlap.resummed == 3  # every step summed again: its early buckets unused
    assert owner._overlap.early_launches == 0
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), plain.parameters()))
