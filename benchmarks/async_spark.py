"""P13: P12 on Spark local[2], beside Elephas 7.3's asynchronous parameter server on the same Spark settings.

The same data (digits, P12's split), model (Dense 32, Adam 0.01), 64-row batches, epochs and slowdown
(every batch costs PAUSE seconds, three times as long on one of the two workers) for every contestant:
- nbdist ``--strategy allreduce`` and ``--strategy async`` with the workers as Spark tasks: P12's cell
  (``benchmarks/async_slow.py``, its PyDataset sleeping in ``__getitem__``) with ``--backend spark``;
- Elephas ``AsynchronousSparkModel(mode="asynchronous")`` and ``mode="hogwild"`` (``frequency="epoch"``,
  its default), sleeping in a Keras callback after each batch, three times as long in partition 1
  (``benchmarks/elephas_async_digits.py``, in Elephas's own venv, a process of its own: it needs numpy < 2).
Both sides: ``local[2]``, UI off, ``spark.driver.host`` and ``SPARK_LOCAL_IP`` 127.0.0.1, one warm-up
fit first, unreported, and every nbdist run waits until two warm workers listen (it would otherwise
import TensorFlow when it follows a short run, as async runs are). nbdist's time is its summed epoch
times and the cell's wall time; Elephas's is the wall time of ``fit`` (it reports no epochs).
Accuracy: the returned model on the 450 held-out rows.

    PYTHONPATH=. python benchmarks/async_spark.py [--epochs 10] [--repeats 3] [--install]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"  # both sides: Spark and Elephas's parameter server on loopback
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import async_slow  # noqa: E402
import elephas_compare as ec  # noqa: E402

log = logging.getLogger(__name__)
MODES = ("asynchronous", "hogwild")


def wait_for_warm_workers(spark: Any, count: int = 2, timeout: float = 60.0) -> float:
    """Wait until ``count`` warm workers listen on this session's executor; the seconds waited.

    An executor starts a warm worker when a task ends (nbdist/spark/warm.py) and it listens once it has
    imported TensorFlow (5-15 s here): a run started sooner cold-starts its workers, so without this wait
    whichever run follows a short one pays the imports. Local mode: the pool is named after the
    ``pyspark.daemon`` process, a child of this session's JVM."""
    import glob
    import time

    jvm = spark.sparkContext._gateway.proc.pid
    root = Path(tempfile.gettempdir()) / f"nbdist-warm-{os.getuid()}"
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for pool in root.glob("*-*"):
            try:
                stat = Path(f"/proc/{pool.name.split('-')[0]}/stat").read_text()
            except (OSError, ValueError):
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == jvm and len(glob.glob(str(pool / "*.sock"))) >= count:
                return time.monotonic() - t0
        time.sleep(0.5)
    log.warning("no %d warm workers after %.0f s: the next run starts its own", count, timeout)
    return time.monotonic() - t0


def run_elephas(data: Path, epochs: int, pause: float, repeats: int, timeout: float = 900.0) -> dict[str, Any]:
    """Elephas's runs, or ``{"error": why}`` when its process failed."""
    cmd = [str(ec.elephas_python()), str(HERE / "elephas_async_digits.py"), str(data), "--epochs", str(epochs),
           "--pause", str(pause), "--repeats", str(repeats), "--modes", ",".join(MODES)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": ""}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"Elephas took over {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": f"Elephas failed: {out.stderr.strip()[-300:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(epochs: int = 10, pause: float = 0.06, repeats: int = 3, install: bool = False) -> dict[str, Any]:
    """nbdist's P12 figures on Spark, then Elephas's (``elephas_skipped`` says why not, when not)."""
    with tempfile.TemporaryDirectory(prefix="nbdist-p13-") as tmp:
        data = ec.write_digits(Path(tmp) / "digits_split.npz")  # P12's split: test_size 0.25, random_state 0
        reason = ec.elephas_ready()
        if reason and install:
            reason = ec.install_elephas()
        elephas = run_elephas(data, epochs, pause, repeats) if reason is None else {}
    waited: list[float] = []
    spark = ec.start_spark(2)  # after Elephas's context is gone: one JVM at a time
    try:
        out = async_slow.measure(epochs, pause, repeats, backend="spark",
                                 before=lambda: waited.append(wait_for_warm_workers(spark)))
    finally:
        spark.stop()
    out["warm_wait_seconds"] = waited
    out["elephas_skipped"] = reason or elephas.get("error")
    for run in elephas.get("runs", []):
        key = f"elephas_{run['mode']}{'_slow' if run['slowed'] else ''}"
        if "error" in run:
            out.setdefault(f"{key}_error", run["error"])
        else:
            out.setdefault(f"{key}_wall", []).append(run["seconds"])
            out.setdefault(f"{key}_accuracy", []).append(run["accuracy"])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--pause", type=float, default=0.06)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--install", action="store_true", help="create Elephas's venv from PyPI when missing")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(measure(a.epochs, a.pause, a.repeats, a.install), indent=1))


if __name__ == "__main__":
    main()
