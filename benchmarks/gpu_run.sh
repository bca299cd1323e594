#!/usr/bin/env bash
# On the lent GPU machine (see benchmarks/gpu_bundle.sh): install the carried wheels
# beside the image's torch/transformers, then run gpu_check at the Kimi-K2.5 draft
# shape (SHAPE=tiny STEPS=4 SEQ_LEN=256: a CPU dry run). Everything it reports lands in $OUT (gpu_check.json, gpu_check.log).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "no nvidia-smi"; } | tee "$OUT/gpu_check.log"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu_check.log"
python3 benchmarks/gpu_check.py --shape "${SHAPE:-kimi}" --steps "${STEPS:-12}" --seq-len "${SEQ_LEN:-8192}" --out /tmp/gpu-check 2>&1 \
  | grep -v "pin_memory\|super().__init__(loader)" | tee -a "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
cp /tmp/gpu-check/gpu_check.json "$OUT/" 2>/dev/null
exit "$rc"
