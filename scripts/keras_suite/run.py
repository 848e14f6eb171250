"""Keras' own trainer, model and callback tests with every ``keras.Model.fit`` routed through ``%%dist_train``.

Not shipped, not in CI. Usage (a Keras source checkout of the installed version)::

    PYTHONPATH=$PWD .venv/bin/python scripts/keras_suite/run.py /path/to/keras \\
        [--backend tensorflow|jax|torch] [--folders keras/src/...] [--out keras_suite_out] [-k EXPR] [--timeout 600]

Runs the selected test files twice from the checkout: locally as they are, then the tests that passed
locally and called ``keras.Model.fit`` with each test's body as the cell of ``%%dist_train --workers 2
--ui none`` (plugin.py). Prints how many pass locally and fit a model, how many of those pass through
nbdist, and each failure's test id and one-line reason; writes ``summary.json`` and ``summary.txt``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent  # the nbdist checkout whose package the workers run
# Keras' trainer, model and callback tests (the test files directly in these folders).
SUITE = ("keras/src/trainers", "keras/src/models", "keras/src/callbacks")


def checkout_version(checkout: Path) -> str:
    text = (checkout / "keras" / "src" / "version.py").read_text()
    found = re.search(r'__version__ = "([^"]+)"', text)
    if not found:
        raise SystemExit(f"{checkout}: no keras/src/version.py with a __version__; pass a Keras source checkout.")
    return found.group(1)


def test_files(checkout: Path, folders: list[str]) -> list[str]:
    files = []
    for folder in folders:
        files += sorted(str(p.relative_to(checkout)) for p in (checkout / folder).glob("*_test.py"))
    return files


def pytest_run(checkout: Path, mode: str, files: list[str], record: Path, only: Path | None, args: argparse.Namespace,
               log: Path) -> dict:
    env = dict(os.environ, KERAS_BACKEND=args.backend,
               PYTHONPATH=os.pathsep.join([str(checkout), str(ROOT), str(HERE)]))
    cmd = [sys.executable, "-m", "pytest", "-p", "plugin", "-p", "no:cacheprovider", "-q", "-o", "addopts=", "-s",
           "--continue-on-collection-errors",
           f"--timeout={args.timeout}", f"--keras-suite-mode={mode}", f"--keras-suite-record={record}",
           "--rootdir", str(checkout)]
    if only is not None:
        cmd.append(f"--keras-suite-only={only}")
    if args.k:
        cmd += ["-k", args.k]
    cmd += files
    print(f"[keras_suite] {mode}: pytest on {len(files)} files (log: {log})", flush=True)
    with open(log, "w") as out:
        subprocess.run(cmd, cwd=checkout, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if not record.exists():
        raise SystemExit(f"the {mode} pytest run wrote no results; see {log}")
    return json.loads(record.read_text())["results"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkout", type=Path, help="a Keras source checkout (tag of the installed version)")
    parser.add_argument("--backend", choices=("tensorflow", "jax", "torch"), default="tensorflow",
                        help="Keras' backend, for both runs")
    parser.add_argument("--folders", nargs="+", default=None,
                        help="the checkout's test folders to run (default: trainers, models and callbacks)")
    parser.add_argument("--out", type=Path, default=Path("keras_suite_out"))
    parser.add_argument("-k", default=None, help="pytest -k expression, to run a part of the suite")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per test")
    parser.add_argument("--reuse-local", action="store_true", help="reuse --out's local.json (nbdist run only)")
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    import keras

    version = checkout_version(checkout)
    if version != keras.__version__:
        raise SystemExit(f"the checkout is Keras {version} but Keras {keras.__version__} is installed; check out "
                         f"tag v{keras.__version__}.")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    files = test_files(checkout, args.folders or list(SUITE))
    local_record = out / "local.json"
    if args.reuse_local and local_record.exists():
        local = json.loads(local_record.read_text())["results"]
    else:
        local = pytest_run(checkout, "local", files, local_record, None, args, out / "local.log")
    fitting = sorted(t for t, r in local.items() if r["outcome"] == "passed" and r["fit_calls"] > 0)
    only = out / "fitting.txt"
    only.write_text("".join(t + "\n" for t in fitting))
    remote = pytest_run(checkout, "nbdist", sorted({t.split("::")[0] for t in fitting}), out / "nbdist.json", only,
                        args, out / "nbdist.log") if fitting else {}
    if args.k:  # part of the suite: the fitting tests -k selected
        fitting = [t for t in fitting if t in remote]
    passed = [t for t in fitting if remote.get(t, {}).get("outcome") == "passed"]
    failures = {t: remote.get(t, {"outcome": "not run", "reason": "not run"}) for t in fitting if t not in passed}
    summary = {
        "keras": version, "backend": args.backend, "magic_line": "%%dist_train --workers 2 --ui none",
        "local": {o: sum(r["outcome"] == o for r in local.values()) for o in ("passed", "failed", "error", "skipped")},
        "pass_locally_and_fit": len(fitting), "pass_through_nbdist": len(passed),
        "failures": {t: {"outcome": r["outcome"], "reason": r.get("reason", ""), "after": r.get("after", [])}
                     for t, r in failures.items()},
        "passed": passed,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    lines = [f"Keras {version}, {args.backend} backend, fit through %%dist_train --workers 2 --ui none",
             f"local: {summary['local']}",
             f"pass locally and fit a keras.Model: {len(fitting)}",
             f"of those, pass through nbdist: {len(passed)}", "", "failures (test id: reason):"]
    for t, r in sorted(failures.items()):
        after = f"  [magic: {r['after'][0]}]" if r.get("after") else ""
        lines.append(f"  {t}: {r.get('reason', '')}{after}")
    text = "\n".join(lines) + "\n"
    (out / "summary.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
