"""``benchmarks/run.py --quick`` runs every row for real and prints one table, JSON and a chart.

Only the shape of the results is asserted (figures on a shared CI machine are noise); the
goals themselves are reported by the full run, not tested.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import wait_no_workers

ROOT = Path(__file__).resolve().parents[2]
ROWS = ["P1", "P2", "P3", "P3w", "P3C", "P3Cw", "P4", "P4M", "P5", "P6", "P7", "P8"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("pyspark")
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result_dir,) = list(out.iterdir())
    return proc.stdout, result_dir


@pytest.mark.timeout(1600)
def test_quick_prints_every_row_once(quick_run):
    stdout, _ = quick_run
    lines = stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("row "))
    assert [ln.split()[0] for ln in lines[header + 1: header + 1 + len(ROWS)]] == ROWS
    assert "nbdist benchmarks (quick)" in stdout


@pytest.mark.timeout(1600)
def test_quick_results_json_and_chart(quick_run):
    _, result_dir = quick_run
    data = json.loads((result_dir / "results.json").read_text())
    assert data["mode"] == "quick" and data["machine"]["cores"] >= 1
    rows = {r["id"]: r for r in data["rows"]}
    assert list(rows) == ROWS
    for row_id, r in rows.items():
        if row_id.startswith("P3") and not r["runs"]:
            # Elephas is installed from PyPI by the full run only; quick says why it is missing.
            assert r["skipped"] and "Elephas" in r["skipped"], r
            assert "acc nbdist" in r["detail"] and "s), Keras" in r["detail"]  # nbdist and Keras still ran
            continue
        assert r["runs"] and not r["skipped"], r
        assert r["min"] <= r["median"] <= r["max"] and r["min"] > 0, r
        assert isinstance(r["met"], bool)
    assert "over Spark Connect" in rows["P3C"]["detail"]
    assert "loopback TCP" in rows["P4"]["detail"] and "bus" in rows["P4"]["detail"]
    assert "allreduce" in rows["P7"]["detail"] and "4 workers on 2 cores" in rows["P7"]["detail"]
    assert (result_dir / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not wait_no_workers()
