#!/usr/bin/env bash
# Cold start and the new MoE families in one device call (run from the repo root; logs and JSON under $OUT):
#   1. bench/serve.py --stage prepare (build the DeepSeek-V3-shaped bf16 source, convert it to mxfp4) while
#      bench/kernel.py's build pass compiles the new families' kernels and the peer's (untimed, own Triton cache);
#   2. bench/serve.py --stage measure alone on the machine: transformers' bf16 model, megamoe with an empty
#      Triton cache, `megamoe-convert warm` (timed), megamoe with an empty Triton cache seeded from the
#      shipped kernel cache -- each a fresh process, in that order;
#   3. bench/kernel.py on the new families (--shapes new) with the peer, decode points first.
#   bash bench/cold.sh            # PEER=DIR (a folder holding triton_kernels), TOKENS=1,8,64, KSECS=budget of 3.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
t0=$(date +%s)
el() { echo "# $(( $(date +%s) - t0 )) s: $*"; }
pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
python -c "import torch, triton; print('# torch', torch.__version__, 'triton', triton.__version__)"
PEER=${PEER:-.peer-tk}
TOKENS=${TOKENS:-1,8,64}
ROWS=${ROWS:-mxfp4,nvfp4,mxfp8}
W=/tmp/serve
KC=/tmp/kernel-tcache
el "prepare + build pass"
( timeout "${PREP_S:-150}" python bench/serve.py --stage prepare --work $W >"$OUT/serve_prepare.log" 2>&1;
  echo "rc=$?" >>"$OUT/serve_prepare.log" ) &
sp=$!
bps=()
for j in 0 1 2 3; do
  TRITON_CACHE_DIR=$KC timeout "${PREP_S:-150}" python bench/kernel.py --shapes new --rows "$ROWS" --tokens "$TOKENS" \
    --mma bf16 --korder frag --no-baseline --no-staging --peer-path "$PEER" --compile-only --job $j/4 --out "" \
    >/tmp/build$j.log 2>&1 &
  bps+=($!)
done
( timeout "${PREP_S:-150}" python -m pytest -q -m gpu tests/runtime/integrations/test_warm.py >"$OUT/gpu_test.log" 2>&1;
  echo "rc=$?" >>"$OUT/gpu_test.log" ) &
tp=$!
wait $sp; wait $tp; for p in "${bps[@]}"; do wait $p; done
echo "# gpu test: $(tail -2 "$OUT/gpu_test.log" | tr '\n' ' ')"
tail -2 "$OUT/serve_prepare.log"; cat /tmp/build*.log | grep -i "error\|Traceback\|unavailable" | head -5
el "serve measure"
timeout "${SERVE_S:-110}" python bench/serve.py --stage measure --work $W --no-static --no-restart \
  --json "$OUT/serve.json" >"$OUT/serve.log" 2>&1; echo "serve rc=$?"
grep -v "^ " "$OUT/serve.log" | tail -8 | cut -c1-1500
el "kernel table"
left=$(( ${TOTAL_S:-235} - ($(date +%s) - t0) ))
TRITON_CACHE_DIR=$KC timeout $(( left > 20 ? left : 20 )) python bench/kernel.py --shapes new --rows "$ROWS" \
  --tokens "$TOKENS" --mma bf16 --korder frag --no-baseline --no-staging --peer-path "$PEER" --out "$OUT/kernel" \
  2>&1 | tee "$OUT/kernel_stdout.log" | grep -v "^#" | grep -v "^|" | tail -60
el "done"
