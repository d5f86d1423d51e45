#!/usr/bin/env bash
# One GPU call: per-kernel tile sweeps (bench/sweep.py) at the points of the whole table that stay below the
# peer (BENCHMARKS.md, "The whole table on the H100"), each group with the peer timed beside it.
#   OUT=/tmp/o PEER=.peer-tk BUDGET_S=585 PARTS=abc bash bench/below_peer_gpu.sh
# a: the mid regime (32 pairs per expert) at 512 tokens, 32- and 64-pair row blocks: Llama-4-Scout, DeepSeek-V2-Lite,
#    Qwen3-235B; b: nvfp4 of the few-large-expert shapes at 512 tokens (prefill tiles); c: nvfp4 at 64 tokens.
# On request: d, nvfp4 at 4096 tokens with L1 tiles of 64 kernel rows at two CTAs per SM (the 128-row 4-warp tile
# misses two CTAs by 1 KB of shared memory); e, nvfp4's prefill64 L2 tile; f, the 64-row nvfp4 L1 at 4096 tokens on
# the other families; g, the regime's whole L1 / L2 candidate set for mxfp4 at 4096 tokens where it is below the
# peer; h, Llama-4-Maverick at 4096 tokens (32 pairs per expert, the mid regime), 32- and 64-pair rows. d-f led to
# configs.short_k_tiles and the prefill64 nvfp4 L2 entry, which are now the defaults each sweep starts from
# (results: docs/bench-log/kernels.md, "fourth session").
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
[[ $PARTS == *d* ]] && sweep d 260 --shapes qwen3-30b,dsv3,mixtral,glm45 --rows nvfp4 --tokens 4096 \
  --l1 1:64:8:4,1:32:4:3,1:32:8:3,1:64:4:2 --l2 128:4:2
if [[ $PARTS == *e* ]]; then  # the points where the mean is 33-64 pairs per expert (prefill64)
  sweep e1 100 --shapes dsv2-lite --rows nvfp4 --tokens 512 --l1 1:64:4:4 --l2 256:8:3,128:4:3,128:4:2
  sweep e2 100 --shapes dsv3 --rows nvfp4 --tokens 2048 --l1 1:64:4:4 --l2 256:8:3,128:4:3,128:4:2
  sweep e3 100 --shapes qwen3-235b --rows nvfp4 --tokens 1024 --l1 1:64:4:4 --l2 256:8:3,128:4:3,128:4:2
fi
[[ $PARTS == *f* ]] && sweep f 150 --shapes kimi-k2,qwen3-235b,dbrx,llama4-scout,qwen3-next,dsv2-lite --rows nvfp4 \
  --tokens 4096 --l1 1:64:8:4,1:32:4:3 --l2 128:4:2
[[ $PARTS == *g* ]] && sweep g 200 --shapes kimi-k2,glm45,mixtral,dbrx,llama4-scout --rows mxfp4 --tokens 4096
[[ $PARTS == *h* ]] && sweep h 120 --shapes llama4-maverick --rows mxfp4,nvfp4 --tokens 4096 --block-m 32,64
el "done"
