#!/usr/bin/env bash
# Builds a folder to copy to a one-GPU machine (no internet there) and run there:
#   bash benchmarks/gpu_check/make_bundle.sh [DEST]      (from the project's root; DEST defaults to .gpu)
# DEST gets: nbdist_src/ (this checkout's nbdist/ and pyproject.toml: the GPU machine imports it from
# PYTHONPATH, none of the project's pins are installed there), whl/ (the packages that machine lacks, as
# cp312 wheels: keras, namex, optree; packaging and typing_extensions as a fallback), and the check scripts.
# Then: echo "/$(basename DEST)/" >> .git/info/exclude, copy DEST to the GPU machine and run there
#   CHECK_BUDGET_S=390 bash DEST/check.sh   (about 6 minutes). What it measures: README.md here.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DEST="${1:-.gpu}"
[[ -d nbdist && -f pyproject.toml ]] || { echo "run this from the project's root" >&2; exit 2; }
rm -rf "$DEST"; mkdir -p "$DEST/nbdist_src" "$DEST/whl/opt"
cp -r nbdist pyproject.toml "$DEST/nbdist_src/"
find "$DEST/nbdist_src" -name __pycache__ -prune -exec rm -rf {} +
git rev-parse HEAD > "$DEST/nbdist_src/COMMIT" 2>/dev/null || true
cp "$HERE/check.sh" "$HERE/check.py" "$HERE/nbcheck_models.py" "$HERE/README.md" "$DEST/"
KERAS=$( (.venv/bin/python -c "import keras; print(keras.__version__)" || python3 -c "import keras; print(keras.__version__)") 2>/dev/null || echo 3.15.1)
dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$@"; }
dl "$DEST/whl" "keras==$KERAS" namex optree
dl "$DEST/whl/opt" packaging typing_extensions
du -sh "$DEST"
