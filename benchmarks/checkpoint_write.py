"""How long the driver's per-epoch checkpoint write takes (it runs on the event loop's thread).

Prints one table measured in this run: model size, atomic save time (temp file, fsync,
rename), load time, and write throughput relative to a plain np.save of the same bytes.
Usage: python benchmarks/checkpoint_write.py [--sizes-mb 1 10 100]
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np

from nbdist.driver import checkpoint


def _time(fn, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 10, 100])
    args = p.parse_args()
    print(f"{'weights MB':>10} {'save s':>8} {'load s':>8} {'save MB/s':>10} {'save / np.save':>15}")
    for mb in args.sizes_mb:
        n = int(mb * 2**20 / 4)
        # Weights plus Adam's two slots: three times the model's bytes go to disk.
        w = [np.random.default_rng(0).normal(size=n).astype("float32")]
        ckpt = checkpoint.Checkpoint(epoch=1, weights=w, optimizer_weights=[w[0], w[0]], iterations=1,
                                     history={"loss": [1.0]})
        with tempfile.TemporaryDirectory() as d:
            # Each lambda is timed at once; the defaults bind this size's values all the same.
            save = _time(lambda d=d, ckpt=ckpt: checkpoint.save(d, ckpt))
            load = _time(lambda d=d: checkpoint.load(d))
            plain_path = os.path.join(d, "plain.npy")
            plain = _time(lambda p=plain_path, w=w: np.save(p, np.concatenate([w[0], w[0], w[0]])))
        print(f"{mb:>10.0f} {save:>8.3f} {load:>8.3f} {3 * mb / save:>10.0f} {save / plain:>15.2f}")


if __name__ == "__main__":
    main()
