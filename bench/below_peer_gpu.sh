#!/usr/bin/env bash
# One GPU call: per-kernel tile sweeps (bench/sweep.py) at the points of the whole table that stay below the
# peer (BENCHMARKS.md, "The whole table on the H100"), each group with the peer timed beside it.
#   OUT=/tmp/o PEER=.peer-tk BUDGET_S=585 PARTS=abc bash bench/below_peer_gpu.sh
# a: the mid regime (32 pairs per expert) at 512 tokens, 32- and 64-pair row blocks: Llama-4-Scout, DeepSeek-V2-Lite,
#    Qwen3-235B; b: nvfp4 of the few-large-expert shapes at 512 tokens (prefill tiles); c: nvfp4 at 64 tokens.
set -u
OUT=${OUT:-/tmp/below_peer}
BUDGET_S=${BUDGET_S:-585}
source "$(dirname "$0")/gpu_setup.sh"
PEER=${PEER:-.peer-tk}
PARTS=${PARTS:-abc}
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
sweep() {  # tag, seconds, sweep.py arguments
  local tag=$1 s=$2; shift 2
  el "sweep $tag: $*"
  timeout -k 10 "$(tmo "$s")" $PY bench/sweep.py --peer-path "$PEER" --w-tile 16 --jobs 12 --iters 5 \
    --budget-s "$(( $(tmo "$s") - 30 ))" --tag "_$tag" --out "$OUT" "$@" >"$OUT/sweep_$tag.out" 2>&1
  echo "rc=$?"; grep -vE "^#   " "$OUT/sweep_$tag.out" | tail -20
}
[[ $PARTS == *a* ]] && sweep a 260 --shapes llama4-scout,dsv2-lite,qwen3-235b --rows nvfp4,mxfp4 --tokens 512 --block-m 32,64
[[ $PARTS == *b* ]] && sweep b 160 --shapes mixtral,dbrx --rows nvfp4 --tokens 512
[[ $PARTS == *c* ]] && sweep c 200 --shapes dsv3,mixtral,llama4-maverick --rows nvfp4 --tokens 64
el "done"
