#!/usr/bin/env bash
# nbdist's GPU check. From the folder make_bundle.sh built (DEST), run:  bash DEST/check.sh
# Writes $OUT/check.log, $OUT/results.json, $OUT/steps/*.json, $OUT/worker_logs/ (OUT defaults to /tmp/out).
# Knobs: CHECK_BUDGET_S (total seconds, default 390), CHECK_QUICK=1 (small sizes), CHECK_FORCE_CPU=1 (run
# the GPU steps on a CPU, to test this script), CHECK_STEPS="env torch_gpu ..." (a subset), PYTHON
# (default python3), CHECK_NO_INSTALL=1 (use the Python's own keras instead of gpu/whl), CHECK_WHEELS
# (another wheel folder, e.g. cp311 ones to test this script), CHECK_SITE (default /tmp/site).
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT/steps"
export OUT PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
BUDGET="${CHECK_BUDGET_S:-390}"
START=$(date +%s)
DEADLINE=$((START + BUDGET))
LOG="$OUT/check.log"
exec > >(tee -a "$LOG") 2>&1

echo "=== nbdist GPU check: $(date -u +%FT%TZ) on $(hostname), budget ${BUDGET} s, OUT=$OUT"
echo "=== nbdist source: $HERE/nbdist_src (commit $(cat "$HERE/nbdist_src/COMMIT" 2>/dev/null))"

# 1. Packages the machine lacks (keras, namex, optree; packaging / typing_extensions only if missing).
SITE="${CHECK_SITE:-/tmp/site}"
WHL="${CHECK_WHEELS:-$HERE/whl}"
if [ "${CHECK_NO_INSTALL:-0}" != 1 ]; then
  t0=$(date +%s)
  timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$SITE" "$WHL"/*.whl || echo "!!! wheel install failed (rc $?)"
  for mod in packaging typing_extensions; do
    if ! "$PY" -c "import $mod" 2>/dev/null; then
      echo "=== $mod missing: installing it from $WHL/opt"
      timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
          --target "$SITE" "$WHL"/opt/"$mod"-*.whl || echo "!!! $mod install failed"
    fi
  done
  echo "=== wheels installed into $SITE in $(( $(date +%s) - t0 )) s"
  export PYTHONPATH="$SITE:$HERE/nbdist_src:$HERE${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$HERE/nbdist_src:$HERE${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "=== PYTHONPATH=$PYTHONPATH"
"$PY" - <<EOF > "$OUT/meta.json" 2>/dev/null || true
import json, os, sys, time
print(json.dumps({"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime($START)), "budget_s": $BUDGET,
                  "python": sys.executable, "python_version": sys.version, "PYTHONPATH": os.environ.get("PYTHONPATH"),
                  "quick": "${CHECK_QUICK:-0}", "force_cpu": "${CHECK_FORCE_CPU:-0}", "host": os.uname().nodename,
                  "commit": open("$HERE/nbdist_src/COMMIT").read().strip() if os.path.exists("$HERE/nbdist_src/COMMIT") else None}))
EOF

EXTRA=()
[ "${CHECK_QUICK:-0}" = 1 ] && EXTRA+=(--quick)
[ "${CHECK_FORCE_CPU:-0}" = 1 ] && EXTRA+=(--force-cpu)

# Leftover nbdist workers of a step that was killed (they die with their parent; this is a backstop).
# Only this check's own: their environment carries NBCHECK_RUN (workers inherit the driver's environment).
export NBCHECK_RUN="nbcheck-$$-$START"
reap_workers() {
  local pid
  for pid in $(pgrep -f "nbdist.worker" || true); do
    if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qx "NBCHECK_RUN=$NBCHECK_RUN"; then
      echo "!!! leftover worker process $pid after $1: $(tr '\0' ' ' < /proc/$pid/cmdline 2>/dev/null | cut -c1-200); killing it"
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
}

# step name, Keras backend, seconds at most, extra env
run_step() {
  local name=$1 backend=$2 cap=$3; shift 3
  local now left t rc t0
  now=$(date +%s); left=$((DEADLINE - now - 8))
  t=$cap; [ "$left" -lt "$t" ] && t=$left
  if [ "$t" -lt 20 ]; then
    echo "RESULT $name: SKIPPED (total budget: ${left} s left)"
    printf '{"step": "%s", "skipped": "total budget spent (%s s left)", "results": {}}\n' "$name" "$left" \
        > "$OUT/steps/$name.json"
    return
  fi
  echo "=== step $name (KERAS_BACKEND=$backend, up to $t s; $((now - START)) s since start) $*"
  t0=$(date +%s)
  env KERAS_BACKEND="$backend" "$@" timeout -k 5 "$t" "$PY" "$HERE/check.py" --step "$name" --out "$OUT" \
      --deadline $((now + t)) ${EXTRA[@]+"${EXTRA[@]}"}
  rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && echo "RESULT $name: KILLED by its $t s timeout (rc $rc)"
  echo "=== step $name ended rc=$rc after $(( $(date +%s) - t0 )) s"
  reap_workers "$name"
  "$PY" "$HERE/check.py" --merge --out "$OUT" || true
}

# The issue's goals first (one worker against plain fit, float32 then bf16, on torch and JAX), then two workers
# on the one GPU, JAX's device sum, and the CPU cores: a run out of budget skips the last.
STEPS="${CHECK_STEPS:-env torch_gpu jax_gpu mixed_bf16 mixed_bf16_jax torch_w2 jax_engine cpu_scaling}"
for s in $STEPS; do
  case $s in
    env)         run_step env torch 60 ;;
    torch_gpu)   run_step torch_gpu torch 110 NCCL_DEBUG=WARN ;;
    torch_w2)    run_step torch_w2 torch 100 NCCL_DEBUG=WARN ;;
    jax_gpu)     run_step jax_gpu jax 120 ;;
    jax_engine)  run_step jax_engine jax 60 ;;
    cpu_scaling) run_step cpu_scaling torch 100 CUDA_VISIBLE_DEVICES= ;;
    mixed_bf16)  run_step mixed_bf16 torch 60 ;;
    mixed_bf16_jax) run_step mixed_bf16_jax jax 50 ;;
    *) echo "unknown step $s" ;;
  esac
done
"$PY" "$HERE/check.py" --merge --out "$OUT" || true
echo "=== SUMMARY (also in $OUT/results.json)"
"$PY" -c "import json,sys; [print('  ' + l) for l in json.load(open(sys.argv[1]))['summary']]" "$OUT/results.json" || true
echo "=== done in $(( $(date +%s) - START )) s"
sleep 1  # let tee write the last lines into check.log
