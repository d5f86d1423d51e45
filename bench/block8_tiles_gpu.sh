#!/usr/bin/env bash
# One GPU call for the block-FP8 row's prefill kernels: the GPU tests of the row, the tile sweep of the kernels
# at SWEEP_TOKENS (every configuration bitwise against the default; BASELINE, an importable copy of an earlier
# block8, timed and compared in the same process), then the whole layer, triton (with the sweep's tiles pinned)
# against DeepGEMM's fp8_mega_moe, and both against the reference backend at REF_TOKENS. Logs under $OUT.
#   OUT=/tmp/o WHL=../../.whl DG_CACHE_TGZ=../../.whl/dg-jitcache.tgz BUDGET_S=400 bash bench/block8_tiles_gpu.sh
set -u
OUT=${OUT:-/tmp/block8_tiles}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-400} MARGIN_S=${MARGIN_S:-8}
source "$(dirname "$0")/gpu_setup.sh"
SWEEP_TOKENS=${SWEEP_TOKENS:-2048,4096}
SWEEP_BM=${SWEEP_BM:-32,64,128}
GRID=${SWEEP_GRID:-split}
BASE=${BASELINE:+--baseline $BASELINE}
el "phase 1: sweep compile (background), GPU tests of the row"
timeout "$(tmo 150)" $PY bench/block8_gpu.py sweep --compile-only --jobs ${JOBS:-12} --grid "$GRID" \
  --tokens "$SWEEP_TOKENS" --bm "$SWEEP_BM" --out "$OUT" >"$OUT/sweep_compile.log" 2>&1 &
P=$!
MEGAMOE_TRITON_REPORT=$OUT/report.jsonl timeout "$(tmo 140)" $PY -m pytest -q -m gpu \
  tests/runtime/backends/test_triton_fp8_block.py 2>&1 | tee "$OUT/tests_block8.log" | tail -5
wait $P; el "sweep compile: $(tail -1 "$OUT/sweep_compile.log")"
el "phase 2: sweep timing"
timeout "$(tmo 100)" $PY bench/block8_gpu.py sweep --jobs 1 --reps 6 --grid "$GRID" --tokens "$SWEEP_TOKENS" \
  --bm "$SWEEP_BM" $BASE --out "$OUT" 2>&1 | tee "$OUT/sweep.log" | grep -E "baseline|best|adopt" | cut -c1-600
PIN=""
[ -f "$OUT/pin.json" ] && PIN=$OUT/pin.json && el "pin: $(cat "$PIN")"
el "phase 3: layer bench (deepgemm vs triton; both against the reference at ${REF_TOKENS:-2048,512})"
BLOCK8_PIN=$PIN timeout "$(tmo 400)" $PY bench/block8_pin.py bench/deepgemm_sm90.py --layer --skip-checks --skip-bf16 \
  --bench-tokens "${BENCH_TOKENS:-4096,2048,512}" --vs-reference "${REF_TOKENS:-2048,512}" --triton-budget-s 1000 \
  --out "$OUT" 2>&1 | tee "$OUT/bench_layer.log" | grep -vE "^\{" | tail -12
el "done"
