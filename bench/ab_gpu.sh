#!/usr/bin/env bash
# One GPU call: the layer before and after a kernel change, same machine, same call. BASE is a folder holding the
# old tree's megamoe_runtime/ and bench/ (e.g. `git archive OLD megamoe_runtime bench | tar x -C .devrun/base`);
# the tree itself is the new one. Kernels of both are built first (in parallel with TESTS, the GPU tests to run
# on the new tree), then bench/kernel.py times the old and the new layer at the same points, the peer beside the new.
#   OUT=/tmp/o BASE=.devrun/base PEER=.peer-tk SHAPES=qwen3-30b,dsv3 ROWS=nvfp4 TOKENS=64,512,4096 \
#     TESTS="tests/runtime/backends/test_triton.py -k nvfp4" bash bench/ab_gpu.sh
set -u
OUT=${OUT:-/tmp/ab}
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/gpu_setup.sh"
BASE=${BASE:-.devrun/base} PEER=${PEER:-.peer-tk}
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
ARGS=(--shapes "${SHAPES:-qwen3-30b}" --rows "${ROWS:-nvfp4}" --tokens "${TOKENS:-64,512,4096}" --mma bf16 --korder frag
      --no-baseline --no-staging --no-peer8)
BUILDS=()
NB=${BUILD_JOBS:-4}
for ((j = 0; j < NB; j++)); do
  timeout -k 10 "$(tmo 100000)" $PY "$BASE/bench/kernel.py" "${ARGS[@]}" --compile-only --job "$j/$NB" --out "" \
    >"$OUT/build_base_$j.log" 2>&1 & BUILDS+=($!)
  timeout -k 10 "$(tmo 100000)" $PY bench/kernel.py "${ARGS[@]}" --peer-path "$PEER" --compile-only --job "$j/$NB" \
    --out "" >"$OUT/build_new_$j.log" 2>&1 & BUILDS+=($!)
done
if [ -n "${TESTS:-}" ]; then
  el "GPU tests: $TESTS"
  timeout -k 10 "$(tmo 200)" $PY -m pytest -q -m gpu -n 4 -p no:cacheprovider -rfE $TESTS >"$OUT/tests.log" 2>&1
  echo "rc=$?"; tail -2 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
fi
wait "${BUILDS[@]}"
el "builds done"; tail -n 3 "$OUT"/build_*.log | grep -iE "error|Traceback" | head
for side in base new base2; do
  case $side in base|base2) S="$BASE/bench/kernel.py"; P=();; new) S=bench/kernel.py; P=(--peer-path "$PEER");; esac
  el "time $side"
  timeout -k 10 "$(tmo 200)" $PY "$S" "${ARGS[@]}" "${P[@]}" --out "$OUT/$side" >"$OUT/$side.log" 2>&1; echo "rc=$?"
  grep -E "^\S+ +\S+ +bf16" "$OUT/$side.log" | cut -c1-90
done
el "done"
rm -f "$OUT"/build_*.log
