#!/usr/bin/env bash
# The one prepared check for a lent GPU machine (H100/H200, fresh box, this repo copied).
# Finishes in under 6 minutes: every step has its own `timeout`, and the benchmark gets what the
# earlier steps left (it writes partial JSON, so even a late kill keeps the rows measured).
#   1. Python: .venv (made by `make setup` when absent, bounded: a box without network fails
#      fast there), else a python3 that already has torch + triton + pytest.
#   2. nvidia-smi
#   3. pytest tests/test_triton_ops.py tests/test_triton_attention.py tests/test_llama_megatron.py (natively on CUDA)
#   4. bench/kernels.py with a time budget; JSON to bench/results/kernels.json
# Logs and the JSON are copied to $OUT when that is set.
#   bash bench/gpu_check.sh            GPU_CHECK_TOTAL_S=360 (seconds for all steps)
set -u -o pipefail
cd "$(dirname "$0")/.."
START=$SECONDS
TOTAL=${GPU_CHECK_TOTAL_S:-345}  # under 6 minutes with a margin for the copies
OUT_DIR=${OUT:-}
LOGS=${TMPDIR:-/tmp}/gpu_check  # logs outside the repo; copied to $OUT
mkdir -p "$LOGS"
log() { echo "[gpu_check +$((SECONDS - START))s] $*"; }
left() { echo $((TOTAL - (SECONDS - START))); }
status=0
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

has_stack() { "$1" -c "import torch, triton, pytest" >/dev/null 2>&1; }

# ---- 1. python -------------------------------------------------------------------------------
PY=""
if [ ! -x .venv/bin/python ] && [ "${GPU_CHECK_SKIP_SETUP:-0}" != 1 ] && command -v make >/dev/null; then
  log "no .venv: make setup (at most 150 s)"
  if ! PIP_TIMEOUT=5 PIP_RETRIES=0 timeout -k 5 150 make setup >"$LOGS/setup.log" 2>&1; then
    log "make setup failed or timed out; last lines:"
    tail -n 3 "$LOGS/setup.log"
  fi
fi
if [ -x .venv/bin/python ] && has_stack .venv/bin/python; then
  PY=.venv/bin/python
elif has_stack python3; then
  PY=$(command -v python3)
else
  log "no python with torch, triton and pytest: nothing to check"
  exit 1
fi
timeout 60 "$PY" -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'| triton', triton.__version__, '| cuda', torch.cuda.is_available())" 2>&1 | tee "$LOGS/env.log"

# ---- 2. the device -----------------------------------------------------------------------------
timeout 20 nvidia-smi 2>&1 | tee "$LOGS/nvidia-smi.log" || log "nvidia-smi failed"

# ---- 3. kernel tests (CUDA-native cases run because CUDA is present) ---------------------------
tests=(tests/test_triton_ops.py)
[ -f tests/test_triton_attention.py ] && tests+=(tests/test_triton_attention.py)
# megatron-core LM backend: logits of GPTModel vs our Llama (skipped, and listed as such, without megatron-core)
[ -f tests/test_llama_megatron.py ] && tests+=(tests/test_llama_megatron.py)
t_tests=$(( $(left) / 3 ))
[ "$t_tests" -gt 150 ] && t_tests=150
log "pytest ${tests[*]} (at most ${t_tests} s)"
if ! timeout -k 5 "$t_tests" "$PY" -m pytest -q -p no:cacheprovider -rs "${tests[@]}" 2>&1 | tee "$LOGS/tests.log"; then
  log "kernel tests FAILED or timed out (see tests.log)"
  status=1
fi

# ---- 4. benchmark -----------------------------------------------------------------------------
budget=$(( $(left) - 60 ))  # headroom for compiles, allocation and the copy-bandwidth probe
if [ "$budget" -lt 30 ]; then
  log "too little time left for the benchmark ($(left) s)"
  status=1
else
  log "bench/kernels.py with a ${budget} s measurement budget"
  if ! timeout -k 10 $((budget + 45)) "$PY" bench/kernels.py --time-budget "$budget" \
      --out bench/results/kernels.json 2>&1 | tee "$LOGS/bench.log"; then
    log "benchmark did not finish cleanly (partial JSON kept)"
    status=1
  fi
fi

# ---- results -----------------------------------------------------------------------------------
if [ -n "$OUT_DIR" ]; then
  mkdir -p "$OUT_DIR"
  cp -f bench/results/kernels.json "$OUT_DIR/" 2>/dev/null || log "no kernels.json to copy"
  for f in env nvidia-smi tests bench setup; do
    [ -f "$LOGS/$f.log" ] && cp -f "$LOGS/$f.log" "$OUT_DIR/gpu_check_$f.log"
  done
fi
log "done, status $status"
exit $status
