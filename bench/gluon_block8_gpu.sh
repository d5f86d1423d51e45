#!/usr/bin/env bash
# One GPU call for the Gluon experiment of the block-FP8 row (bench/gluon_block8.py; docs/bench-log/kernels.md,
# the Gluon entry): block8's prefill L2 and L1 timed alone first, then every Gluon configuration against them
# (bytes differing from block8's, median times in CUDA graphs, ratios), each layer in its own process so that a
# fault in one Gluon kernel leaves the other layer's results and block8's times. JSON and logs under $OUT.
#   OUT=/tmp/o BUDGET_S=500 bash bench/gluon_block8_gpu.sh
set -u
OUT=${OUT:-/tmp/gluon_block8}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-500} MARGIN_S=${MARGIN_S:-8}
source "$(dirname "$0")/gpu_setup.sh"
TOKENS=${TOKENS:-2048,4096}
el "phase 1: block8 alone (L2, L1)"
timeout "$(tmo 90)" $PY bench/gluon_block8.py --gpu --skip-compile --variants none --tokens "$TOKENS" \
  --json "$OUT/block8.json" 2>&1 | tee "$OUT/block8.log" | grep -E "^L[12] " | cut -c1-200
el "phase 2: Gluon L2 configurations"
timeout "$(tmo 240)" $PY bench/gluon_block8.py --gpu --skip-compile --kernels l2 --tokens "$TOKENS" \
  --json "$OUT/gluon_l2.json" 2>&1 | tee "$OUT/gluon_l2.log" | grep -E "^L2 |Error" | cut -c1-240
el "phase 3: Gluon L1 configurations"
timeout "$(tmo 200)" $PY bench/gluon_block8.py --gpu --skip-compile --kernels l1 --tokens "$TOKENS" \
  --json "$OUT/gluon_l1.json" 2>&1 | tee "$OUT/gluon_l1.log" | grep -E "^L1 |Error" | cut -c1-240
el "done"
