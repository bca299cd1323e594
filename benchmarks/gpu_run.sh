#!/usr/bin/env bash
# On the lent GPU machine (see benchmarks/gpu_bundle.sh): install the carried wheels
# beside the image's torch/transformers, then run gpu_check at the Kimi-K2.5 draft
# shape, then through torchrun (DDP, FSDP). SHAPE=tiny STEPS=4 SEQ_LEN=256: a CPU
# dry run. What it reports lands in $OUT (*gpu_check*.json, gpu_check.log).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"; } | tee "$OUT/gpu_check.log"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu_check.log"
check() {  # TAG LIMIT_S gpu_check.py ARGS...: output to the log, JSON results to $OUT/TAG-*.json;
  local tag=$1 limit=$2; shift 2  # a hang costs LIMIT_S, not the rest
  local out f; out=$(mktemp -d /tmp/gpu-check.XXXX)
  timeout -k 10 "$limit" python3 benchmarks/gpu_check.py --out "$out" "$@" 2>&1 | tee -a "$OUT/gpu_check.log"
  local rc=${PIPESTATUS[0]}
  for f in "$out"/gpu_check*.json; do [ -e "$f" ] && cp "$f" "$OUT/$tag-$(basename "$f")"; done
  rm -rf "$out"  # a Kimi-shape check leaves ~20 GB (states, checkpoints): the next one needs the disk
  echo "== gpu_check.py $* -> exit $rc" | tee -a "$OUT/gpu_check.log"
  return "$rc"
}
rc=0
# 0. the same path at the tiny shape first: a failure of compile, flex attention or the fused loss shows in seconds
check tiny 120 --shape tiny --steps 4 --seq-len 1024 --samples 6 || rc=1
# 1. the Kimi-K2.5 draft shape in one process: flex attention, fused loss, bf16, compile; tokens/s, peak memory,
#    under Muon (the Kimi recipe's optimizer) then AdamW on the same extraction: the step-time ratio.
#    Should the fused loss fail, the eager loss still gives the shape's figures. 2026-12-04 on an H200: the Muon
#    arm took 219 s (116 s of it compile), so 420 s leaves the AdamW arm its time. Its data loading was 57% of
#    a step with num_workers 0; gpu_check now loads with the Kimi recipe's 2 workers (--num-workers).
check kimi 420 --shape "${SHAPE:-kimi}" --steps "${STEPS:-12}" --seq-len "${SEQ_LEN:-8192}" --optimizers muon,adamw \
  || { rc=1; check kimi-eager-loss 200 --shape "${SHAPE:-kimi}" --steps "${STEPS:-12}" --seq-len "${SEQ_LEN:-8192}" --loss eager; }
# 2. through torchrun as a multi-GPU pod trains (NCCL, DDP then FSDP), small and short, under Muon
check ddp 90 --shape tiny --ranks 1 --steps 4 --seq-len 1024 || rc=1
check fsdp 90 --shape tiny --ranks 1 --fsdp --steps 4 --seq-len 1024 || rc=1
exit "$rc"
