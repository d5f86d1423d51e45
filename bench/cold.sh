#!/usr/bin/env bash
# Cold start, then the kernel table beside the peer, in one device call (run from the repo root):
#   1. bench/serve.py --stage prepare (build the DeepSeek-V3-shaped bf16 source on the GPU, save it, convert it
#      to mxfp4 on the host CPUs); once the GPU part is over, bench/kernel.py times the decode points (TOKENS)
#      beside the host-side save and convert, and is stopped when the prepare step ends;
#   2. bench/serve.py --stage measure: transformers' bf16 model, megamoe with an empty Triton cache,
#      `megamoe-convert warm` (timed), megamoe with an empty Triton cache seeded from the shipped kernel
#      cache -- each a fresh process, in that order;
#   3. bench/kernel.py with the peer in the same process, alone on the machine: the decode points of the shapes
#      step 1 did not finish, then the prefill points (TOKENS2) while the time budget lasts.
#
#   PEER=.peer-tk bash bench/cold.sh     # PEER: a folder holding OpenAI's triton_kernels (measured, never imported
#                                        # by the package); SHAPES=set,new TOKENS=1,8,64 TOKENS2=512,4096
#                                        # ROWS=mxfp4,nvfp4,mxfp8 TOTAL_S=420 (the whole script's budget, s)
#                                        # SPLITK_S=0 (s for the mxfp8 split-K sweep; 0: none)
#   DRY=1 bash bench/cold.sh             # print the commands only (a CPU check of the plumbing)
# Durations seen on an H200 (2026-12-05): install 7 s, prepare 84 s (build 33 s, convert 46 s), serve
# measurement 103 s (warm 23 s of it), one shape's decode points 42 s with its kernels compiled.
# $OUT receives at most 6 files (the device tool returns 8): run.log (everything printed), serve.json,
# k1/bench.json, k2/bench.json, k3/bench.json, logs.tgz (the per-step logs and the bench.md tables).
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
pack() { for d in k1 k2 k3; do [ -f "$OUT/$d/bench.md" ] && mv "$OUT/$d/bench.md" "$LOGS/$d.md"; done
        tar -czf "$OUT/logs.tgz" -C "$LOGS" . 2>/dev/null; }
trap pack EXIT

PEER=${PEER:-.peer-tk}
SHAPES=${SHAPES:-set,new}
TOKENS=${TOKENS:-1,8,64}
TOKENS2=${TOKENS2:-512,4096}
ROWS=${ROWS:-mxfp4,nvfp4,mxfp8}
WARM_TOKENS=${WARM_TOKENS:-1,2,3,4,8,16,17,32,33,64,65}
W=/tmp/serve
KC=/tmp/kernel-tcache
ktable() {  # NAME SECONDS SHAPES TOKENS: bench/kernel.py with the peer in the same process, log under $LOGS
  TRITON_CACHE_DIR=$KC $X timeout "$2" python bench/kernel.py --shapes "$3" --rows "$ROWS" --tokens "$4" \
    --mma bf16 --korder frag --no-baseline --no-staging --peer-path "$PEER" --out "$OUT/$1" >"$LOGS/$1.log" 2>&1
}
ktable_summary() { grep -v "^#" "$LOGS/$1.log" | grep -v "^|" | grep -v "^peer" | cut -c1-200; }
[ -d "$PEER/triton_kernels" ] || echo "# warning: $PEER holds no triton_kernels: the peer columns stay empty"
if [ -z "$DRY" ]; then
  pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 || { tail -20 "$LOGS/install.log"; exit 1; }
  nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
  python -c "import torch, triton; print('# torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  [ -e .git ] && git log -1 --format='# commit %h %s'  # a staged copy has none (a parent's would mislead)
fi

el "prepare, and the decode points of the kernel table beside it"
( $X timeout "${PREP_S:-170}" python bench/serve.py --stage prepare --work $W >"$LOGS/serve_prepare.log" 2>&1;
  echo "rc=$?" >>"$LOGS/serve_prepare.log" ) &
sp=$!
# the prepare step builds the source model on the GPU for its first seconds, then saves and converts it on the
# host CPUs: the kernel table's timed pass starts after that first part (K1_DELAY s) and is stopped when the
# prepare step ends, so the serve measurement has the machine alone
sleep "${K1_DELAY:-25}"
# started directly (not through ktable) so that $! is the timeout process itself, which the kill below stops
TRITON_CACHE_DIR=$KC $X timeout "${PREP_S:-170}" python bench/kernel.py --shapes "$SHAPES" --rows "$ROWS" \
  --tokens "$TOKENS" --mma bf16 --korder frag --no-baseline --no-staging --peer-path "$PEER" --out "$OUT/k1" \
  >"$LOGS/k1.log" 2>&1 &
kp=$!
wait $sp
el "prepare done; stopping the kernel table"
kill -- "$kp" 2>/dev/null; wait "$kp" 2>/dev/null
sleep 1
tail -3 "$LOGS/serve_prepare.log"
ktable_summary k1

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

# the shapes the first pass did not finish (bench.json holds each shape once its rows are done)
rest=$(${PY:-python} - "$OUT/k1/bench.json" "$SHAPES" <<'EOF'
import json, sys
sys.path.insert(0, "bench")
from kernel import parse_shapes
try:
    done = {r["shape"] for r in json.load(open(sys.argv[1]))["moe"]}
except (OSError, ValueError):
    done = set()
print(",".join(n for n, _ in parse_shapes(sys.argv[2]) if n not in done))
EOF
)
l=$(left)
if [ -n "$rest" ] && [ "$l" -gt 30 ]; then
  el "kernel table, decode points ($TOKENS) of $rest, ${l} s left"
  ktable k2 $(( l - 8 )) "$rest" "$TOKENS"
  echo "k2 rc=$?"
  ktable_summary k2
fi
# opt-in (SPLITK_S=seconds): the mxfp8 row's split-K L2 sweep on the few-large-expert shapes (I / 128 >= 64,
# where configs.split_k_tiles splits the E2M1 rows), L1 and L2 timed apart (bench/sweep.py), and the GPU
# split-K numerics tests; logs into logs.tgz. Adopt a split only where it wins at every measured point.
l=$(left)
if [ "${SPLITK_S:-0}" -gt 0 ] && [ "$l" -gt 40 ]; then
  b=$(( SPLITK_S < l - 10 ? SPLITK_S : l - 10 ))
  el "mxfp8 split-K sweep, ${b} s"
  ts=$(date +%s)
  $X timeout $(( b / 3 )) python -m pytest -q -m gpu tests/runtime/backends/test_triton.py -k split_k \
    >"$LOGS/splitk_test.log" 2>&1; echo "split-K tests rc=$?"; tail -1 "$LOGS/splitk_test.log"
  b=$(( b - ($(date +%s) - ts) ))
  TRITON_CACHE_DIR=$KC $X timeout $(( b > 20 ? b : 20 )) python bench/sweep.py \
    --shapes mixtral,dbrx,llama4-scout,llama4-maverick --rows mxfp8 --tokens "$TOKENS" \
    --l2 "64:4:3:-:-:-:2,64:4:3:-:-:-:4,64:4:4:-:-:-:4,128:4:3:-:-:-:2,128:4:3:-:-:-:4" \
    --budget-s $(( b > 30 ? b - 30 : 10 )) --out "$LOGS/splitk" >"$LOGS/splitk.log" 2>&1
  echo "split-K sweep rc=$?"; grep -v "^#" "$LOGS/splitk.log" | cut -c1-200
fi
l=$(left)
if [ "$l" -gt 40 ] && [ -n "$TOKENS2" ]; then
  el "kernel table, prefill points ($TOKENS2), ${l} s left"
  ktable k3 $(( l - 8 )) "$SHAPES" "$TOKENS2"
  echo "k3 rc=$?"
  ktable_summary k3
fi
el "done"
