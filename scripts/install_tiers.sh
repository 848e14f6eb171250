#!/usr/bin/env bash
# The install tier (CONTRIBUTING.md, "The install tier"): one fresh venv, nbdist's wheel built once here, the
# other wheels from pip's cache (the test venv's install filled it) or this machine's disk (torch).
#   1. nbdist[jax,notebook] only: no TensorFlow, no torch; load_ext, one and two workers train (two meet through
#      shared memory), an engine that needs torch is refused in one sentence; then the quickstart notebook and
#      %dist_evaluate on 2 workers
#   2. the user's own torch ($KEPT_TORCH: another release than the tests' 2.13.0), then nbdist[jax,torch]:
#      pip leaves that torch in place, and nbdist loads on Keras' torch backend
# Usage: scripts/install_tiers.sh [python]   (the Python that builds the wheel and the venv; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${1:-python3}
# 2.14.1, a CUDA build (5.4 GB installed), is the other torch on this machine's disk; KEPT_TORCH=2.13.0 for a
# quicker local run (then it is the tests' release, kept all the same).
KEPT_TORCH=${KEPT_TORCH:-2.14.1}
OUT=$ROOT/build/install-tiers
rm -rf "$OUT"
mkdir -p "$OUT"
tick() { date +%s; }
# pip, without this machine's notices about index folders it lacks (its errors still show).
pip_in() {
  local venv=$1
  shift
  "$venv/bin/pip" install --quiet --disable-pip-version-check "$@" 2> >(grep -v "is neither a file nor a directory" >&2)
}
# Run from $OUT, so nothing of the checkout is on the path.
check() { (cd "$OUT" && "$OUT/venv/bin/python" "$@"); }

start=$(tick)
"$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$OUT/wheels" . 2>/dev/null \
  || "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$OUT/wheels" .
WHEEL=$(ls "$OUT"/wheels/nbdist-*.whl)

t0=$(tick)
"$PY" -m venv "$OUT/venv"
pip_in "$OUT/venv" "nbdist[jax,notebook] @ file://$WHEEL"
echo "install tier: nbdist[jax,notebook] in $(( $(tick) - t0 )) s," \
     "site-packages $(du -sh "$OUT"/venv/lib/python3*/site-packages | cut -f1)"
check "$ROOT/tests/install/jax_only.py" no-torch
check "$ROOT/tests/install/jax_only.py" quickstart
echo "install tier: the JAX-only checks and quickstart done at $(( $(tick) - start )) s"

t0=$(tick)
pip_in "$OUT/venv" "torch==$KEPT_TORCH"
t1=$(tick)
pip_in "$OUT/venv" "nbdist[jax,torch,notebook] @ file://$WHEEL"
check "$ROOT/tests/install/torch_kept.py" "$KEPT_TORCH"
echo "install tier: torch $KEPT_TORCH in $(( t1 - t0 )) s, then nbdist[torch] in $(( $(tick) - t1 )) s"
echo "install tier: $(( $(tick) - start )) s in all"
rm -rf "$OUT/venv"
