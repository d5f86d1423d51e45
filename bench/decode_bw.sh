#!/usr/bin/env bash
# Decode-size weight streaming on Hopper: one device call that builds, times and profiles (run from the repo
# root; logs and JSON under $OUT).
#   bash bench/decode_bw.sh
# 1. every candidate's kernels built at once in parallel processes (small shapes with the same kernel
#    specializations; triton's disk cache hands them to the timing passes), 2. bench/sweep.py (L1 and L2 timed
#    apart, then the whole layer) at 8 and 64 tokens on DeepSeek-V3 and Qwen3-30B for mxfp4
#    and mxfp8, 3. the mxfp8 split-K L2 sweep on Mixtral and DBRX and how far split-K moves the output
#    (bench/split_bits.py), 4. Nsight Compute stall profiles of the default decode kernels (bench/ncu_stalls.py)
#    and 5. the peer at the same points, in between (most wanted first; each phase starts only if time is left).
# PEER: a folder holding OpenAI's triton_kernels (default .peer-tk); TOTAL_S: the phases start only while
# this many seconds have not passed; PHASES: which of build,fp4,fp8,split,bits,ncu,peer run (default all).
# Everything comes back as one archive, $OUT/decode_bw.tgz (the device hands back only so many files).
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
PEER=${PEER:-.peer-tk}
TOTAL_S=${TOTAL_S:-400}
mkdir -p "$OUT"
PHASES=${PHASES:-build,fp4,fp8,split,bits,ncu,peer}  # also: ahead (scale bytes one K step ahead vs byte loads)
on() { [[ ",$PHASES," == *",$1,"* ]]; }
t0=$(date +%s)
left() { echo $(( TOTAL_S - ($(date +%s) - t0) )); }
pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw,memory.total --format=csv,noheader \
  2>&1 | tee "$OUT/card.txt"
echo "# setup $(( $(date +%s) - t0 )) s"

# candidates (bench/sweep.py --l1 / --l2 syntax); each list's i-th entries are built by one process
L1_FP4="1:64:4:4:-:-:128 1:64:4:2:-:-:128 1:32:4:4:-:-:128 1:128:8:3:-:-:128 1:64:4:3:plain:-:128 1:64:4:3:-:-:0"
L2_FP4="128:4:4 128:4:2 64:4:4 256:8:3 128:4:3:plain 64:4:3"
L1_FP8="1:32:4:4 1:32:4:2 1:64:4:3 1:32:4:3:fold 1:64:8:3:-:-:0 1:64:4:4:-:-:128"
L2_FP8="64:4:4 64:4:2 128:4:3 64:4:3:fold 32:4:3 128:4:4"
L2_SPLIT="64:4:3:-:-:-:1 64:4:3:-:-:-:2 64:4:3:-:-:-:4 128:4:3:-:-:-:1 128:4:3:-:-:-:2 128:4:3:-:-:-:4"
comma() { echo "$*" | tr ' ' ','; }

# 1. build
pids=()
on build || build() { :; }
on build && build() {  # row shapes tokens l1 l2 tag
  python bench/sweep.py --compile-only --rows "$1" --shapes "$2" --tokens "$3" --w-tile 16 --l1 "$4" --l2 "$5" \
    --out "" >"$OUT/build_$6.log" 2>&1 &
  pids+=($!)
}
read -ra a1 <<<"$L1_FP4"; read -ra a2 <<<"$L2_FP4"
# (a small shape with DeepSeek-V3's experts and top-k gives the same kernels; Qwen3-30B's own routing
# kernels in the first process only)
on fp4 && for i in "${!a1[@]}"; do build mxfp4 "$([ "$i" = 0 ] && echo qwen3-30b,)2048,768,256,8" 8,64 "${a1[$i]}" "${a2[$i]}" fp4_$i; done
read -ra a1 <<<"$L1_FP8"; read -ra a2 <<<"$L2_FP8"
on fp8 && for i in "${!a1[@]}"; do build mxfp8 "$([ "$i" = 0 ] && echo qwen3-30b,)2048,768,256,8" 8,64 "${a1[$i]}" "${a2[$i]}" fp8_$i; done
read -ra a2 <<<"$L2_SPLIT"
on split && for i in "${!a2[@]}"; do build mxfp8 4096,2048,8,2,4096,2048,16,4 8,64 1:32:4:3 "${a2[$i]}" split_$i; done
if on ahead; then  # the default tiles with KernelConfig.scale_load "ahead" (env) for the "ahead" phase
  MEGAMOE_TRITON_SCALES=ahead build mxfp8 qwen3-30b,2048,768,256,8 8,64 1:32:4:3 64:4:3 ahead_mxfp8
  MEGAMOE_TRITON_SCALES=bytes build mxfp8 qwen3-30b,2048,768,256,8 8,64 1:32:4:3 64:4:3 bytes_mxfp8
fi
for p in "${pids[@]}"; do wait "$p"; done
grep -l "Traceback" "$OUT"/build_*.log 2>/dev/null | head -3 | while read -r f; do echo "# $f:"; tail -5 "$f"; done
echo "# build $(( $(date +%s) - t0 )) s"

# 2. per-kernel sweeps at decode sizes (the default config's tiles are always the first candidate)
sweep() {  # tag row shapes tokens l1 l2 budget [extra]
  local b=$7; [ "$(left)" -lt "$b" ] && b=$(left)
  [ "$b" -lt 20 ] && { echo "# skipped sweep $1 (time)"; return; }
  timeout $(( b + 60 )) python bench/sweep.py --rows "$2" --shapes "$3" --tokens "$4" --w-tile 16 --iters 5 \
    --rep 100 --l1 "$5" --l2 "$6" --budget-s "$b" --tag "_$1" --out "$OUT" "${@:8}" 2>&1 | tee "$OUT/sweep_$1.txt" \
    | grep -v "^#   bm=" | tail -30
  echo "# sweep $1 done $(( $(date +%s) - t0 )) s"
}
on fp4 && sweep fp4 mxfp4 dsv3,qwen3-30b 8,64 "$(comma $L1_FP4)" "$(comma $L2_FP4)" 80
on fp8 && sweep fp8 mxfp8 dsv3,qwen3-30b 8,64 "$(comma $L1_FP8)" "$(comma $L2_FP8)" 60
on split && sweep split mxfp8 mixtral,dbrx 8,64 1:32:4:3 "$(comma $L2_SPLIT)" 50
on bits && [ "$(left)" -gt 40 ] && timeout $(( $(left) - 10 )) python bench/split_bits.py --shapes mixtral,dbrx --rows mxfp8 \
  --tokens 8,64 --splits 2,4 --out "$OUT" 2>&1 | tee "$OUT/split_bits.txt"

# 4. stall profiles of the default decode kernels (DeepSeek-V3, 8 tokens)
prof() {  # tag row kernel-regex [one_forward args]
  [ "$(left)" -lt 45 ] && { echo "# skipped ncu $1 (time)"; return; }
  timeout $(( $(left) - 5 )) ncu --clock-control none -k "regex:$3" -s 2 -c 1 --set full --import-source no \
    -o "$OUT/ncu_$1" python bench/one_forward.py --row "$2" --tokens 8 --calls 3 "${@:4}" >"$OUT/ncu_$1.log" 2>&1
  python bench/ncu_stalls.py "$OUT/ncu_$1.ncu-rep" --top 25 2>&1 | tee "$OUT/ncu_$1.txt" | head -45
  echo "# ncu $1 done $(( $(date +%s) - t0 )) s"
}
# 2b. scale bytes one K step ahead against the byte loads, default tiles (docs/KERNELS.md)
if on ahead; then
  for sl in bytes ahead; do  # mxfp8 only: the E2M1 rows never take it (launch._scale_ahead)
    MEGAMOE_TRITON_SCALES=$sl sweep "${sl}_mxfp8" mxfp8 dsv3,qwen3-30b 8,64 1:32:4:3 64:4:3 40
  done
  prof l1_mxfp8_ahead mxfp8 _l1_kernel --cfg scale_load=ahead
fi
on ncu && prof l1_mxfp4 mxfp4 _l1_kernel

# 5. the peer on the same shapes, routing and token counts (its MXFP4 weights; bench/kernel.py bench_peer)
on peer && [ "$(left)" -gt 60 ] && timeout $(( $(left) - 10 )) python - "$PEER" "$OUT" <<'PY' 2>&1 | grep -v "^#" | tee "$OUT/peer.txt"
import json, sys
sys.path.insert(0, "bench")
from kernel import SHAPES, bench_peer
res = {}
for s in ("qwen3-30b", "dsv3"):
    sh = SHAPES[s]
    res[s] = {T: v[0] * 1e3 for T, v in bench_peer(sys.argv[1], sh["H"], sh["I"], sh["E"], sh["K"], [8, 64]).items()}
    print(s, res[s], flush=True)
    open(sys.argv[2] + "/peer.json", "w").write(json.dumps(res))
PY
on ncu && prof l1_mxfp8 mxfp8 _l1_kernel
on ncu && prof l2_mxfp4 mxfp4 _l2_kernel
rm -f "$OUT"/*.ncu-rep.source.csv
echo "# total $(( $(date +%s) - t0 )) s"
# one archive: the device hands back only so many files
rm -f "$OUT"/build_*.log
tar czf "$OUT/decode_bw.tgz" -C "$OUT" --exclude=decode_bw.tgz . && find "$OUT" -type f ! -name decode_bw.tgz -delete
ls -la "$OUT"
