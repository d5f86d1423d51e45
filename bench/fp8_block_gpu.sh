#!/usr/bin/env bash
# One GPU call for the block-FP8 row (fp8_block): its GPU tests (triton block8 and the deepgemm SM90 backend),
# the numerics diagnostics, the prefill tile sweep, then the layer and load benches with the tiles the sweep
# chose (pinned in-process by bench/block8_pin.py). Everything under $OUT/d, packed into $OUT/fp8_block.tgz;
# the phases share a deadline (BUDGET_S seconds from the start) so the pack always happens.
#   OUT=/tmp/o WHL=../../.whl BUDGET_S=350 bash bench/fp8_block_gpu.sh
# A confirming call: CONFIRM=1 (block8 tests, the fine sweep at SWEEP_TOKENS, the layer bench at BENCH_TOKENS; no
# deepgemm tests, probe, diag or load bench).
set -u
OUT=${OUT:-/tmp/fp8_block_out}
D=$OUT/d
mkdir -p "$D"
BUDGET_S=${BUDGET_S:-350} MARGIN_S=${MARGIN_S:-12}
source "$(dirname "$0")/gpu_setup.sh"
CONFIRM=${CONFIRM:-0}
GRID=${SWEEP_GRID:-full}
SWEEP_TOKENS=${SWEEP_TOKENS:-4096}
SWEEP_BM=${SWEEP_BM:-64,128}
BENCH_TOKENS=${BENCH_TOKENS:-4096,512,64,8,1}
el "phase 1: deepgemm tests, sweep compile, load source build (background); probe, block8 tests, diag"
P1=; P3=
if [ "$CONFIRM" = 0 ]; then
  timeout "$(tmo 140)" $PY -m pytest -q -m gpu tests/runtime/backends/test_deepgemm_sm90.py >"$D/tests_deepgemm.log" 2>&1 &
  P1=$!
  timeout "$(tmo 140)" $PY bench/load_sm90.py --build-only --experts 24 --workdir /tmp/load_sm90 --out "$D" \
    >"$D/load_build.log" 2>&1 &
  P3=$!
fi
timeout "$(tmo 140)" $PY bench/block8_gpu.py sweep --compile-only --jobs 10 --grid "$GRID" --tokens "$SWEEP_TOKENS" \
  --bm "$SWEEP_BM" --out "$D" >"$D/sweep_compile.log" 2>&1 &
P2=$!
[ "$CONFIRM" = 0 ] && { timeout "$(tmo 40)" $PY bench/block8_gpu.py probe --out "$D" || el "probe failed"; }
MEGAMOE_TRITON_REPORT=$D/report.jsonl timeout "$(tmo 120)" $PY -m pytest -q -m gpu \
  tests/runtime/backends/test_triton_fp8_block.py 2>&1 | tee "$D/tests_block8.log" | tail -5
if [ "$CONFIRM" = 0 ]; then
  el "diag"
  timeout "$(tmo 80)" $PY bench/block8_gpu.py diag --out "$D" || el "diag failed"
  wait $P1; el "deepgemm tests: $(tail -1 "$D/tests_deepgemm.log")"
  wait $P3; el "load build: $(tail -1 "$D/load_build.log")"
fi
wait $P2; el "sweep compile: $(tail -1 "$D/sweep_compile.log")"

el "phase 2: sweep timing"
timeout "$(tmo 70)" $PY bench/block8_gpu.py sweep --jobs 1 --reps 6 --grid "$GRID" --tokens "$SWEEP_TOKENS" \
  --bm "$SWEEP_BM" --out "$D" || el "sweep failed"
PIN=""
[ -f "$D/pin.json" ] && PIN=$D/pin.json && el "pin: $(cat "$PIN")"
if [ -n "$PIN" ] && $PY -c "import json, sys; from megamoe_runtime.backends.triton import block8; \
  sys.exit(0 if block8.Block8Config(**json.load(open('$PIN'))) == block8.TILES['prefill'] else 1)"; then
  el "the sweep's choice is the committed prefill tiles: no pin"
  PIN=""
fi

el "phase 3: block8 tests at the prefill points with the pinned tiles"
if [ -n "$PIN" ]; then
  BLOCK8_PIN=$PIN PYTHONPATH=$PYTHONPATH:$PWD/bench MEGAMOE_TRITON_REPORT=$D/report_pinned.jsonl timeout "$(tmo 60)" \
    $PY -m pytest -q -m gpu -p block8_pin tests/runtime/backends/test_triton_fp8_block.py -k "300 or dsv3 or graph" \
    2>&1 | tee "$D/tests_block8_pinned.log" | tail -3
fi

el "phase 4: layer bench (deepgemm vs triton vs bf16 grouped_mm)"
BLOCK8_PIN=$PIN timeout "$(tmo 150)" $PY bench/block8_pin.py bench/deepgemm_sm90.py --layer --skip-checks \
  --bench-tokens "$BENCH_TOKENS" --triton-budget-s 1000 --out "$D" 2>&1 | tee "$D/bench_layer.log" | tail -9

if [ "$CONFIRM" = 0 ]; then
  el "phase 5: load bench"
  timeout "$(tmo 60)" $PY bench/load_sm90.py --experts 24 --workdir /tmp/load_sm90 --out "$D" 2>&1 | tee "$D/load.log" | tail -4
fi
el "done"
rm -f "$D/probe.pt.keep"
tar czf "$OUT/fp8_block.tgz" -C "$OUT" d
rm -rf "$D"
