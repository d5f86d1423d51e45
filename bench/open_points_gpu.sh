#!/usr/bin/env bash
# One GPU call for what the tree still owes a GPU (BENCHMARKS.md names each as "not yet timed"): the GPU kernel
# tests on the tree as it is, the block-FP8 layer at decode sizes beside DeepGEMM (its gate/up kernels were timed
# at 512-4096 tokens only), the off-by-default KernelConfig options (scale_load "ahead" on mxfp8, k_unroll 2)
# against the default tiles, and the decode table with the peer and % of copy bandwidth. Kernels are built in the background while the tests run;
# everything comes back as $OUT/all.tgz (the device hands back only a few files).
#   OUT=/tmp/o WHL=.whl DG_CACHE_TGZ=.whl/dg-jitcache.tgz PEER=.peer-tk BUDGET_S=430 bash bench/open_points_gpu.sh
# PEER: a folder holding OpenAI's triton_kernels package (PEER/triton_kernels). SHAPES / TOKENS: the decode table's shapes and token counts (default dsv3,qwen3-30b at 8,64);
# ROWS: the table's rows (default mxfp4,nvfp4,mxfp8); TESTS_S: phase 1's time limit (default 200);
# BUILD_JOBS: processes building the table's kernels first (default 4); TABLE_S: the table's time limit (default 150). PHASES: which of
# phases below to run (default 1234; on request 5, the Gluon L2 through the runtime, and 6, the L1 with TMA weights).
set -u
OUT=${OUT:-/tmp/open_points}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-430} MARGIN_S=${MARGIN_S:-10}
source "$(dirname "$0")/gpu_setup.sh"
PEER=${PEER:-.peer-tk}
SHAPES=${SHAPES:-dsv3,qwen3-30b}
TOKENS=${TOKENS:-8,64}
PHASES=${PHASES:-1234}
on() { [[ $PHASES == *$1* ]]; }
$PY -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
TABLE=(--peer-path "$PEER" --shapes "$SHAPES" --rows "${ROWS:-mxfp4,nvfp4,mxfp8}" --tokens "$TOKENS" --mma bf16 --korder frag
       --no-baseline --no-staging)
BUILDS=()
NB=${BUILD_JOBS:-4}
on 4 && for ((j = 0; j < NB; j++)); do
  timeout -k 10 "$(tmo 100000)" $PY bench/kernel.py "${TABLE[@]}" --compile-only --job "$j/$NB" --out "" >"$OUT/build_table_$j.log" 2>&1 &
  BUILDS+=($!)
done
if on 1; then
el "1: GPU kernel tests"
timeout -k 10 "$(tmo "${TESTS_S:-200}")" $PY -m pytest -q -m gpu -n 8 -p no:cacheprovider tests/runtime/backends -rfE >"$OUT/kernels.log" 2>&1
echo "rc=$?"; tail -3 "$OUT/kernels.log"; grep -E "^(FAILED|ERROR)" "$OUT/kernels.log" | head -20
fi
if on 2; then
el "2: block-FP8 layer at decode sizes beside DeepGEMM"
timeout -k 10 "$(tmo 80)" $PY bench/deepgemm_sm90.py --layer --skip-checks --skip-bf16 --bench-tokens 64,8,1 \
  --out "$OUT/block8_decode" >"$OUT/block8_decode.log" 2>&1; echo "rc=$?"
grep -vE "^\{" "$OUT/block8_decode.log" | tail -10
fi
if on 5; then
el "5: the Gluon L2 through the runtime: its GPU test, then the block-FP8 layer at prefill sizes with and without it"
timeout -k 10 "$(tmo 120)" $PY -m pytest -q -m gpu -p no:cacheprovider -rfE \
  tests/runtime/backends/test_triton_fp8_block.py -k "gluon" >"$OUT/gluon_test.log" 2>&1
echo "rc=$?"; tail -3 "$OUT/gluon_test.log"; grep -E "^(FAILED|ERROR)" "$OUT/gluon_test.log" | head
timeout -k 10 "$(tmo 200)" $PY bench/deepgemm_sm90.py --layer --skip-checks --skip-bf16 --gluon-l2 \
  --bench-tokens "${GLUON_TOKENS:-4096,2048,512}" --out "$OUT/gluon_layer" >"$OUT/gluon_layer.log" 2>&1; echo "rc=$?"
grep -vE "^\{" "$OUT/gluon_layer.log" | tail -14
fi
if on 6; then
el "6: the block-FP8 L1 with its weights by TMA (bench/gluon_block8.py --kernels l1t) against block8's L1"
timeout -k 10 "$(tmo 200)" $PY bench/gluon_block8.py --gpu --skip-compile --kernels l1t --tokens "${L1T_TOKENS:-4096,2048}" \
  --json "$OUT/l1t.json" >"$OUT/l1t.log" 2>&1; echo "rc=$?"
grep -E "^L1 T=" "$OUT/l1t.log" | tail -16; grep -E "Error|error" "$OUT/l1t.log" | head -5
fi
if on 3; then
el "3: the off-by-default kernel options against the default tiles, whole layer (bench/config_pair.py)"
timeout -k 10 "$(tmo 70)" $PY bench/config_pair.py --set scale_load=ahead --rows mxfp8 --shapes "$SHAPES" --tokens "$TOKENS" \
  --rounds 2 --json "$OUT/scale_load_ahead.json" 2>&1 | tail -6
timeout -k 10 "$(tmo 90)" $PY bench/config_pair.py --set k_unroll=2 --rows mxfp4,mxfp8 --shapes "$SHAPES" --tokens "$TOKENS" \
  --rounds 2 --json "$OUT/k_unroll.json" 2>&1 | tail -10
fi
if on 4; then
el "4: decode table with the peer (% of copy)"
# the builds by pid: a bare `wait` also waits for gpu_setup.sh's `tee` process substitution (bash >= 5.1),
# which never ends while this script writes to it
[ ${#BUILDS[@]} -gt 0 ] && wait "${BUILDS[@]}"
el "builds done"
timeout -k 10 "$(tmo "${TABLE_S:-150}")" $PY bench/kernel.py "${TABLE[@]}" --out "$OUT/table" >"$OUT/table.log" 2>&1; echo "rc=$?"
grep -vE "^\{" "$OUT/table.log" | tail -40
fi
el "done"
rm -f "$OUT"/build_*.log
tar czf /tmp/open_points.tgz -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv /tmp/open_points.tgz "$OUT/all.tgz"
