# Sourced by the one-call GPU drivers (bench/*_gpu.sh): the shared deadline, DeepGEMM's wheels and JIT cache,
# and the card's name at the top of the log. Expects OUT set (made here if missing); reads BUDGET_S (seconds from now
# that every phase must fit in), MARGIN_S (kept free at the end for packing), WHL (a folder of wheels to put
# beside the project) and DG_CACHE_TGZ (a tarball of DeepGEMM's JIT cache, holding dgcache/).
mkdir -p "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
T0=$(date +%s)
DEADLINE=$((T0 + ${BUDGET_S:-400}))
# elapsed-time log line; a phase's time limit: what it asks for, or what is left before the deadline
el() { echo "[$(($(date +%s) - T0))s] $*"; }
tmo() { local l=$((DEADLINE - $(date +%s) - ${MARGIN_S:-8})); [ "$1" -lt "$l" ] && echo "$1" || echo $((l > 1 ? l : 1)); }
PY=${PY:-python}
if [ -n "${WHL:-}" ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
    || el "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
[ -f "${DG_CACHE_TGZ:-}" ] && tar xzf "$DG_CACHE_TGZ" -C /tmp && export DG_JIT_CACHE_DIR=/tmp/dgcache
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
