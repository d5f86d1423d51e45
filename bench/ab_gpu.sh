#!/usr/bin/env bash
# One GPU call: the layer at two or more trees, same machine, same call. TREES names them in timing order as
# name=folder (a folder holding that tree's megamoe_runtime/ and bench/, e.g. `git archive OLD megamoe_runtime
# bench | tar x -C .devrun/base`; "." is the working tree); the first is timed again at the end (its drift is the
# spread). BASE=folder alone means TREES="base=folder new=.". Kernels of every tree are built first (in parallel
# with TESTS, the GPU tests to run on the working tree), then bench/kernel.py times each tree's layer at the same
# points, the peer beside the working tree. Everything comes back as $OUT/all.tgz.
#   OUT=/tmp/o BASE=.devrun/base PEER=.peer-tk SHAPES=qwen3-30b,dsv3 ROWS=nvfp4 TOKENS=64,512,4096 \
#     TESTS="tests/runtime/backends/test_triton.py -k nvfp4" bash bench/ab_gpu.sh
# Each tree runs with PYTHONPATH on its own folder: the installed start-up hook (megamoe-autoregister.pth) imports
# megamoe_runtime when the interpreter starts, from the first folder on the path, so a script's own sys.path insert
# comes too late to pick the tree (it did: every side of the A/B calls before this check ran the working tree).
set -u
OUT=${OUT:-/tmp/ab}
BUDGET_S=${BUDGET_S:-540}
source "$(dirname "$0")/gpu_setup.sh"
PEER=${PEER:-.peer-tk}
TREES=${TREES:-"base=${BASE:-.devrun/base} new=."}
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
ARGS=(--shapes "${SHAPES:-qwen3-30b}" --rows "${ROWS:-nvfp4}" --tokens "${TOKENS:-64,512,4096}" --mma bf16 --korder frag
      --no-baseline --no-staging --no-peer8)
# run a tree's bench/kernel.py with that tree on the path (and the peer beside the working tree)
side() {  # folder, then kernel.py arguments
  local dir; dir=$(cd "$1" && pwd); shift
  local peer=(); [ "$dir" = "$PWD" ] && peer=(--peer-path "$PEER")
  PYTHONPATH=$dir${WHL:+:/tmp/site} $PY "$dir/bench/kernel.py" "${ARGS[@]}" "${peer[@]}" "$@"
}
# `side` under a time limit (timeout runs programs, not shell functions): limit, folder, kernel.py arguments
timed_side() {
  local lim=$1; shift
  timeout -k 10 "$lim" bash -c "$(declare -f side); $(declare -p ARGS PY PEER); side \"\$@\"" _ "$@"
}
for t in $TREES; do  # each tree must import its own package
  dir=$(cd "${t#*=}" && pwd)
  got=$(PYTHONPATH=$dir $PY -c "import megamoe_runtime.backends.triton.configs as c; print(c.__file__)")
  case $got in "$dir"/*) el "${t%%=*}: $got";; *) el "${t%%=*} imports $got, not $dir: stop"; exit 1;; esac
done
BUILDS=()
NB=${BUILD_JOBS:-4}
for t in $TREES; do
  for ((j = 0; j < NB; j++)); do
    timed_side "$(tmo 100000)" "${t#*=}" --compile-only --job "$j/$NB" --out "" >"$OUT/build_${t%%=*}_$j.log" 2>&1 &
    BUILDS+=($!)
  done
done
if [ -n "${TESTS:-}" ]; then
  el "GPU tests: $TESTS"
  timeout -k 10 "$(tmo 200)" $PY -m pytest -q -m gpu -n 4 -p no:cacheprovider -rfE $TESTS >"$OUT/tests.log" 2>&1
  echo "rc=$?"; tail -2 "$OUT/tests.log"; grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20
fi
wait "${BUILDS[@]}"
el "builds done"; tail -n 3 "$OUT"/build_*.log | grep -iE "error|Traceback" | head
FIRST=${TREES%% *}
for t in $TREES "${FIRST%%=*}2=${FIRST#*=}"; do
  el "time ${t%%=*}"
  timed_side "$(tmo 200)" "${t#*=}" --out "$OUT/${t%%=*}" >"$OUT/${t%%=*}.log" 2>&1; echo "rc=$?"
  grep -E "^\S+ +\S+ +bf16" "$OUT/${t%%=*}.log" | cut -c1-90
done
el "done"
rm -f "$OUT"/build_*.log
# one archive: the device hands back only a few files (each tree leaves a folder and a log)
tar czf /tmp/ab_gpu.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/ab_gpu.tgz "$OUT/all.tgz"
