"""How much to multiply the learning rate by when N workers train data-parallel.

N workers train like one with an N-times larger batch (exactly so for plain SGD), so they end behind a local
fit epoch for epoch. The linear scaling rule (Goyal et al. 2017) multiplies the rate by N: ``auto`` applies it
to adaptive optimizers and keeps plain SGD's exact big-batch semantics, ``linear`` to every optimizer,
``none`` never.
"""
from __future__ import annotations

PLAIN_SGD = {"SGD"}


def lr_scale_factor(mode: str, optimizer_class: str, world_size: int) -> float:
    if world_size <= 1 or mode == "none":
        return 1.0
    if mode == "linear":
        return float(world_size)
    if mode == "auto":
        return 1.0 if optimizer_class in PLAIN_SGD else float(world_size)
    raise ValueError(f"unknown lr scaling mode {mode!r}")
