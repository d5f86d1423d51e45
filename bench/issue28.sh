#!/usr/bin/env bash
# Issue 28 device calls: one script per call that builds, checks and times (run from the repo root on the H200).
#   bash bench/issue28.sh sweep   # per-kernel tile sweep of the shape set + the peer, at 1/8/64/512/4096 tokens
#   bash bench/issue28.sh final   # GPU tests of the triton backend + the whole set against the peer (bench/kernel.py)
# Logs and JSON under $OUT; the triton cache goes back as tcache.tgz.* (carry it as .tcache to skip rebuilding).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
t0=$(date +%s)
if ls .tcache/tcache.tgz.* >/dev/null 2>&1; then mkdir -p ~/.triton && cat .tcache/tcache.tgz.* | tar xzf - -C ~/.triton; fi
pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader 2>&1
echo "# setup $(( $(date +%s) - t0 )) s"
case "$1" in
sweep)
  python bench/sweep.py --shapes "${SHAPES:-kimi-k2,qwen3-235b,qwen3-30b,glm45,mixtral,dbrx}" --rows mxfp4,nvfp4 \
    --tokens 4096,512,64,8,1 --w-tile 16 --iters 5 --rep 100 --jobs 12 --budget-s "${BUDGET:-330}" \
    --peer-path .peer-tk --out "$OUT" 2>&1 | grep -v "^#   bm=" | tee "$OUT/sweep_stdout.log" | tail -80
  ;;
final)
  # the GPU tests of the triton backend run beside the build pass (both mostly compile), the timing after both
  ( timeout "${TEST_S:-200}" python -m pytest -q -m gpu -n 6 tests/runtime/backends/test_triton.py \
      tests/runtime/backends/test_triton_tiles.py tests/runtime/backends/test_triton_fold_flags.py \
      tests/runtime/backends/test_triton_route.py >"$OUT/tests.log" 2>&1; echo "rc=$?" >>"$OUT/tests.log" ) &
  tp=$!
  bps=()
  for j in 0 1 2 3 4 5 6; do
    python bench/kernel.py --shapes "${SHAPES:-set}" --rows "${ROWS:-mxfp4,nvfp4,mxfp8}" --mma bf16 --korder frag \
      --no-baseline --no-staging --compile-only --job $j/7 --out "" >"$OUT/build$j.log" 2>&1 &
    bps+=($!)
  done
  wait $tp; for p in "${bps[@]}"; do wait $p; done
  cat "$OUT"/build*.log | grep -i "error\|Traceback" | head -5; rm -f "$OUT"/build*.log
  echo "# tests: $(tail -2 "$OUT/tests.log" | tr '\n' ' ') ($(( $(date +%s) - t0 )) s)"
  python bench/kernel.py --peer-path .peer-tk --shapes "${SHAPES:-set}" --rows "${ROWS:-mxfp4,nvfp4,mxfp8}" \
    --mma bf16 --korder frag --no-baseline --no-staging ${NOPEER8:+--no-peer8} --out "$OUT/final" 2>&1 \
    | tee "$OUT/final_stdout.log" | grep -v "^#" | grep -v "^|" | tail -120
  ;;
esac
echo "# total $(( $(date +%s) - t0 )) s"
[ "$1" = final ] && [ -z "$KEEP_CACHE" ] && { ls -la "$OUT"; exit 0; }
tar czf - -C ~/.triton cache --exclude='*.llir' --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.ptx' \
  --exclude='*.source' 2>/dev/null | split -b 15M - "$OUT/tcache.tgz."
ls -la "$OUT"
