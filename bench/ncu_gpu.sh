#!/usr/bin/env bash
# One GPU call: Nsight Compute on one kernel of the triton backend's default forward at a few points
# (bench/one_forward.py), each report summarized by bench/ncu_stalls.py (headline metrics, stall reasons, the
# SASS lines with the most stall samples).
#   OUT=/tmp/o POINTS="dsv2-lite:nvfp4:512:_l1_kernel dsv2-lite:mxfp4:512:_l1_kernel" bash bench/ncu_gpu.sh
set -u
OUT=${OUT:-/tmp/ncu}
BUDGET_S=${BUDGET_S:-585}
source "$(dirname "$0")/gpu_setup.sh"
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
for p in ${POINTS:-dsv2-lite:nvfp4:512:_l1_kernel dsv2-lite:mxfp4:512:_l1_kernel}; do
  IFS=: read -r shape row tokens kernel <<<"$p"
  tag=${shape}_${row}_${tokens}${kernel}
  el "ncu $p"
  # -s 2: skip the first forward's launches of that kernel (the main and the tail launch)
  timeout -k 10 "$(tmo 150)" ncu --clock-control none -k "regex:^${kernel}" -s 2 -c 1 --set full --import-source no \
    -o "$OUT/$tag" $PY bench/one_forward.py --shape "$shape" --row "$row" --tokens "$tokens" --calls 3 \
    >"$OUT/$tag.ncu.log" 2>&1; echo "rc=$?"; tail -2 "$OUT/$tag.ncu.log"
  [ -f "$OUT/$tag.ncu-rep" ] && $PY bench/ncu_stalls.py "$OUT/$tag.ncu-rep" --top 25 >"$OUT/$tag.txt" 2>&1 && head -60 "$OUT/$tag.txt"
  rm -f "$OUT/$tag.ncu-rep"
done
el "done"
