"""Why 2 workers on one GPU ended 0.086 from the local fit (issue 36), measured without a GPU.

The same step twice from the same weights on the same rows: the batch's gradient taken at once (the local
fit, batch 512) and as the mean of its two halves' gradients (2 workers of 256 each, what allreduce sums).
Exact arithmetic gives the same update; floating point sums the rows in another order, a difference of
rounding size. The first GPU run compared with ``max_rel_norm_diff``: per tensor, the norm of the weights'
difference over the norm of the local fit's weights, the largest over tensors. This script follows that
difference epoch by epoch for Adam (lr 1e-4, as that run) and SGD (lr 0.01, the GPU check's control), on
the check's 25M MLP (2048-4096-4096-10) and generated rows, in torch on the CPU, no Keras, no nbdist: only
the order of summation differs.

    PYTHONPATH=. python benchmarks/summation_order.py [--hidden 4096 4096] [--epochs 4] [--rows 16384]
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import numpy as np
import torch


def generated(rows: int, dim: int, classes: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The GPU check's data (nbcheck_models.generated): Gaussian rows labelled by a random projection."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, dim), dtype=np.float32)
    w = rng.standard_normal((dim, classes)).astype(np.float32)
    return x, np.argmax(x @ w, axis=1).astype(np.int64)


def mlp(dim: int, hidden: list[int], classes: int = 10) -> torch.nn.Sequential:
    """Keras' Dense defaults: Glorot-uniform kernels, zero biases (a bias's norm starts at 0 and stays small)."""
    torch.manual_seed(2)
    layers: list[torch.nn.Module] = []
    for width in [*hidden, classes]:
        linear = torch.nn.Linear(dim, width)
        torch.nn.init.xavier_uniform_(linear.weight)
        torch.nn.init.zeros_(linear.bias)
        layers += [linear, torch.nn.ReLU()]
        dim = width
    return torch.nn.Sequential(*layers[:-1])


def gradients(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


@torch.no_grad()
def max_rel_norm_diff(a: torch.nn.Module, b: torch.nn.Module) -> dict[str, float]:
    """The GPU check's measure (check.compare), with where it is largest."""
    rel = {name: float((p - q).norm() / max(float(q.norm()), 1e-30))
           for (name, p), q in zip(a.named_parameters(), b.parameters())}
    worst = max(rel, key=rel.get)
    abs_diff = max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters()))
    return {"max_rel_norm_diff": rel[worst], "worst_tensor": worst, "max_abs_diff": abs_diff,
            "worst_tensor_norm": float(dict(b.named_parameters())[worst].norm())}


def run(optimizer: str, lr: float, x: np.ndarray, y: np.ndarray, hidden: list[int], batch: int,
        epochs: int) -> list[dict]:
    whole = mlp(x.shape[1], hidden)
    halves = copy.deepcopy(whole)
    make = (lambda ps: torch.optim.Adam(ps, lr=lr, eps=1e-7)) if optimizer == "adam" else \
        (lambda ps: torch.optim.SGD(ps, lr=lr))
    opt_w, opt_h = make(whole.parameters()), make(halves.parameters())
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    out = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        for start in range(0, len(x), batch):
            xb, yb = xt[start:start + batch], yt[start:start + batch]
            for p, g in zip(whole.parameters(), gradients(whole, xb, yb)):
                p.grad = g
            opt_w.step()
            half = len(xb) // 2
            first = gradients(halves, xb[:half], yb[:half])
            second = gradients(halves, xb[half:], yb[half:])
            for p, g1, g2 in zip(halves.parameters(), first, second):
                p.grad = (g1 + g2) / 2  # equal halves: the rows-weighted mean allreduce takes
            opt_h.step()
        row = {"optimizer": optimizer, "epoch": epoch + 1, "seconds": round(time.perf_counter() - t0, 1),
               **max_rel_norm_diff(halves, whole)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 4096])
    p.add_argument("--rows", type=int, default=16384)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--epochs", type=int, default=4)
    args = p.parse_args()
    x, y = generated(args.rows, args.dim)
    rows = run("adam", 1e-4, x, y, args.hidden, args.batch, args.epochs)
    rows += run("sgd", 0.01, x, y, args.hidden, args.batch, args.epochs)
    print("| optimizer | epoch | max rel norm diff | in tensor (its norm) | max abs diff |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['optimizer']} | {r['epoch']} | {r['max_rel_norm_diff']:.3g} | {r['worst_tensor']} "
              f"({r['worst_tensor_norm']:.3g}) | {r['max_abs_diff']:.3g} |")


if __name__ == "__main__":
    main()
