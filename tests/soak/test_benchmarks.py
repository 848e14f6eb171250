"""``benchmarks/run.py --quick`` runs rows for real and prints one table, JSON and a chart.

Only the shape of the results is asserted (figures on a shared CI machine are noise); the
goals themselves are reported by the full run, not tested. CI runs the harness on one cheap
row (P1: one worker and a plain fit), which is all of the harness (a child process per row, its
JSON, the table, results.json, the chart); ``make test-full`` adds P8 (the quickstart cell with
warm workers). ``NBDIST_BENCH_ROWS=all`` (or a list such as ``P3,P7``) runs those rows through the
same checks.
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
ALL_ROWS = ["P1", "P2", "P3", "P3w", "P3C", "P3Cw", "P4", "P4M", "P5", "P6", "P7", "P8"]
CI_ROWS = "P1"


def wanted() -> tuple[str, list[str]]:
    """The --rows argument and the rows it yields (P3 and P3C give a cold and a warm row each)."""
    arg = os.environ.get("NBDIST_BENCH_ROWS", CI_ROWS).strip().upper()
    if arg == "ALL":
        return ",".join(r for r in ALL_ROWS if not r.endswith("w")), ALL_ROWS
    asked = [r.strip() for r in arg.split(",") if r.strip()]
    return ",".join(asked), [r for r in ALL_ROWS if r in asked or (r.endswith("w") and r[:-1] in asked)]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    pytest.importorskip("matplotlib")
    rows_arg, rows = wanted()
    if any(r.startswith(("P3", "P6")) for r in rows):
        pytest.importorskip("pyspark")
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--quick", "--rows", rows_arg,
                           "--out", str(out)], capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result_dir,) = list(out.iterdir())
    return proc.stdout, result_dir, rows


@pytest.mark.timeout(1600)
def test_quick_prints_every_row_once(quick_run):
    stdout, _, rows = quick_run
    lines = stdout.splitlines()
    header = next(i for i, ln in enumerate(lines) if ln.startswith("row "))
    assert [ln.split()[0] for ln in lines[header + 1: header + 1 + len(rows)]] == rows
    assert "nbdist benchmarks (quick)" in stdout


@pytest.mark.timeout(1600)
def test_quick_results_json_and_chart(quick_run):
    _, result_dir, wanted_rows = quick_run
    data = json.loads((result_dir / "results.json").read_text())
    assert data["mode"] == "quick" and data["machine"]["cores"] >= 1
    rows = {r["id"]: r for r in data["rows"]}
    assert list(rows) == wanted_rows
    for row_id, r in rows.items():
        if row_id.startswith("P3") and not r["runs"]:
            # Elephas is installed from PyPI by the full run only; quick says why it is missing.
            assert r["skipped"] and "Elephas" in r["skipped"], r
            assert "acc nbdist" in r["detail"] and "s), Keras" in r["detail"]  # nbdist and Keras still ran
            continue
        assert r["runs"] and not r["skipped"], r
        assert r["min"] <= r["median"] <= r["max"] and r["min"] > 0, r
        assert isinstance(r["met"], bool) and r["seconds"] >= 0
    details = {
        "P1": ["epoch", "8000 x 64", "3 epochs"],
        "P3C": ["over Spark Connect"],
        "P4": ["loopback TCP", "bus"],
        "P7": ["allreduce", "4 workers on 2 cores"],
        "P8": ["val accuracy", "5 epochs"],
    }
    for row_id, words in details.items():
        if row_id in rows:
            assert all(w in rows[row_id]["detail"] for w in words), rows[row_id]
    assert rows[wanted_rows[0]]["seconds"] > 0  # the first row of each child carries its wall time
    assert (result_dir / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not wait_no_workers()
