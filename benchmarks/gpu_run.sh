#!/usr/bin/env bash
# On the lent GPU machine (see benchmarks/gpu_bundle.sh): install the carried wheels
# beside the image's torch/transformers, then run gpu_check at the Kimi-K2.5 draft
# shape, then through torchrun (DDP, FSDP). SHAPE=tiny STEPS=4 SEQ_LEN=256: a CPU
# dry run. What it reports lands in $OUT (gpu_check*.json, gpu_check.log).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"; } | tee "$OUT/gpu_check.log"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu_check.log"
check() {  # gpu_check.py ARGS...: output to the log, JSON results to $OUT
  local out; out=$(mktemp -d /tmp/gpu-check.XXXX)
  python3 benchmarks/gpu_check.py --out "$out" "$@" 2>&1 | tee -a "$OUT/gpu_check.log"
  local rc=${PIPESTATUS[0]}
  cp "$out"/gpu_check*.json "$OUT/" 2>/dev/null
  echo "== gpu_check.py $* -> exit $rc" | tee -a "$OUT/gpu_check.log"
  return "$rc"
}
rc=0
# 1. the Kimi-K2.5 draft shape in one process: flex attention, fused loss, bf16, compile; tokens/s, peak memory
check --shape "${SHAPE:-kimi}" --steps "${STEPS:-12}" --seq-len "${SEQ_LEN:-8192}" || rc=1
# 2. through torchrun as a multi-GPU pod trains (NCCL, DDP then FSDP), small and short
check --shape tiny --ranks 1 --steps 4 --seq-len 1024 || rc=1
check --shape tiny --ranks 1 --fsdp --steps 4 --seq-len 1024 || rc=1
exit "$rc"
