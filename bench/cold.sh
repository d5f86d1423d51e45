#!/usr/bin/env bash
# Cold start, then the kernel table beside the peer, in one device call (run from the repo root):
#   1. bench/serve.py --stage prepare (build the DeepSeek-V3-shaped bf16 source, convert it to mxfp4) while
#      bench/kernel.py's build pass compiles the table's decode kernels and the peer's (untimed, own Triton
#      cache); the build pass is stopped when the prepare step ends, so the next step has the machine alone;
#   2. bench/serve.py --stage measure: transformers' bf16 model, megamoe with an empty Triton cache,
#      `megamoe-convert warm` (timed), megamoe with an empty Triton cache seeded from the shipped kernel
#      cache -- each a fresh process, in that order;
#   3. bench/kernel.py with the peer in the same process: the decode points (TOKENS) of every shape first,
#      then the prefill points (TOKENS2) while the time budget lasts.
#
#   PEER=.peer-tk bash bench/cold.sh     # PEER: a folder holding OpenAI's triton_kernels (measured, never imported
#                                        # by the package); SHAPES=set,new TOKENS=1,8,64 TOKENS2=512,4096
#                                        # ROWS=mxfp4,nvfp4,mxfp8 TOTAL_S=420 (the whole script's budget, s)
#   DRY=1 bash bench/cold.sh             # print the commands only (a CPU check of the plumbing)
# $OUT receives at most 7 files (the device tool returns 8): run.log (everything printed), serve.json,
# k1/bench.{json,md}, k2/bench.{json,md}, logs.tgz (the per-step logs).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
LOGS=/tmp/cold-logs
mkdir -p "$OUT" "$LOGS"
exec > >(tee -a "$OUT/run.log") 2>&1
t0=$(date +%s)
el() { echo "# $(( $(date +%s) - t0 )) s: $*"; }
left() { echo $(( ${TOTAL_S:-420} - ($(date +%s) - t0) )); }
X=${DRY:+echo DRY:}  # DRY=1: commands printed, not run
pack() { tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; }
trap pack EXIT

PEER=${PEER:-.peer-tk}
SHAPES=${SHAPES:-set,new}
TOKENS=${TOKENS:-1,8,64}
TOKENS2=${TOKENS2:-512,4096}
ROWS=${ROWS:-mxfp4,nvfp4,mxfp8}
WARM_TOKENS=${WARM_TOKENS:-1,2,3,4,8,16,17,32,33,64,65}
W=/tmp/serve
KC=/tmp/kernel-tcache
[ -d "$PEER/triton_kernels" ] || echo "# warning: $PEER holds no triton_kernels: the peer columns stay empty"
if [ -z "$DRY" ]; then
  pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 || { tail -20 "$LOGS/install.log"; exit 1; }
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
  python -c "import torch, triton; print('# torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  git log -1 --format='# commit %h %s' 2>/dev/null || true
fi

el "prepare + build pass"
( $X timeout "${PREP_S:-170}" python bench/serve.py --stage prepare --work $W >"$LOGS/serve_prepare.log" 2>&1;
  echo "rc=$?" >>"$LOGS/serve_prepare.log" ) &
sp=$!
bps=()
for j in 0 1 2 3; do
  TRITON_CACHE_DIR=$KC $X timeout "${PREP_S:-170}" python bench/kernel.py --shapes "$SHAPES" --rows "$ROWS" \
    --tokens "$TOKENS" --mma bf16 --korder frag --no-baseline --no-staging --peer-path "$PEER" --compile-only \
    --job $j/4 --out "" >"$LOGS/build$j.log" 2>&1 &
  bps+=($!)
done
wait $sp
el "prepare done; stopping the build pass"
for p in "${bps[@]}"; do kill -- "$p" 2>/dev/null; done
for p in "${bps[@]}"; do wait "$p" 2>/dev/null; done
sleep 1
tail -3 "$LOGS/serve_prepare.log"
cat "$LOGS"/build*.log | grep -i "error\|Traceback\|unavailable" | head -5

el "serve measure"
$X timeout "${SERVE_S:-170}" python bench/serve.py --stage measure --work $W --no-static --no-restart \
  --warm-tokens "$WARM_TOKENS" --warm-jobs 8 --json "$OUT/serve.json" >"$LOGS/serve.log" 2>&1
echo "serve rc=$?"
grep -v "^ " "$LOGS/serve.log" | tail -8 | cut -c1-1500
[ -f "$OUT/serve.json" ] && python - "$OUT/serve.json" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
for k in ("source", "megamoe_cold_jit", "megamoe_shipped"):
    if k in r:
        print(f"## {k:18s} load {r[k]['load_s']:6.2f} s  first token {r[k]['first_token_s']:6.2f} s  "
              f"peak dev {r[k].get('peak_device_gb')} GB  decode {r[k]['decode_tokens_per_s']} tok/s")
print("## first token vs source:", r.get("first_token_vs_source"))
print("## warm:", {k: r.get("warm", {}).get(k) for k in ("ok", "entries", "seconds", "wall_s", "tokens", "error")})
print("## cold kernels compiled:", sum(r.get("cold_jit_kernels", {}).values()),
      " shipped run compiled anyway:", r.get("shipped_compiled_anyway"))
EOF

el "kernel table, decode points ($TOKENS)"
l=$(left); l=$(( l > 30 ? l - 10 : 20 ))
TRITON_CACHE_DIR=$KC $X timeout $l python bench/kernel.py --shapes "$SHAPES" --rows "$ROWS" --tokens "$TOKENS" \
  --mma bf16 --korder frag --no-baseline --no-staging --peer-path "$PEER" --out "$OUT/k1" \
  >"$LOGS/k1.log" 2>&1
echo "k1 rc=$?"
grep -v "^#" "$LOGS/k1.log" | grep -v "^|" | grep -v "^peer" | grep -v "^Measured" | cut -c1-200
l=$(left)
if [ "$l" -gt 40 ] && [ -n "$TOKENS2" ]; then
  el "kernel table, prefill points ($TOKENS2), ${l} s left"
  TRITON_CACHE_DIR=$KC $X timeout $(( l - 8 )) python bench/kernel.py --shapes "$SHAPES" --rows "$ROWS" \
    --tokens "$TOKENS2" --mma bf16 --korder frag --no-baseline --no-staging --peer-path "$PEER" --out "$OUT/k2" \
    >"$LOGS/k2.log" 2>&1
  echo "k2 rc=$?"
  grep -v "^#" "$LOGS/k2.log" | grep -v "^|" | grep -v "^peer" | grep -v "^Measured" | cut -c1-200
fi
el "done"
