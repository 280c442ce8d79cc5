#!/usr/bin/env bash
# GPU check, prepared as one short script for a machine with one NVIDIA GPU
# (an H200 here). It needs the project's venv (make setup; the pinned torch
# 2.13.0 CPU wheel is replaced by the machine's CUDA build if one is present:
# set TORCH_SPEC to pick it, e.g. TORCH_SPEC="torch==2.13.0" with a CUDA index).
#
#   bash bench/device_check.sh [OUT_DIR]
#
# Writes OUT_DIR/device_pipeline.json (pipeline benchmark on cuda:0 with the
# wan2.1-1.3b backbone shape, random init, bf16: pinned host buffers,
# non-blocking copies, CUDA-event stage timing) and OUT_DIR/device_profile.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-${OUT:-bench/out}}
mkdir -p "$OUT"
PY=${PY:-.venv/bin/python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device_gpu.txt"
"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "this torch has no CUDA: install a CUDA build of torch into the venv first"
print("torch", torch.__version__, "device", torch.cuda.get_device_name(0))
PYEOF
MODEL=${MODEL:-wan2.1-1.3b}
timeout 240 "$PY" -m physis_ros.cli.profile --model "$MODEL" --device cuda:0 --batch-sizes 1,2 --repeats 5 \
  --json "$OUT/device_profile.json"
timeout 300 "$PY" -m physis_ros.cli.bench pipeline --model "$MODEL" --device cuda:0 --workers 2 \
  --plans sequential,step,block,stage --chunks ${CHUNKS:-40} --no-parallel-limit \
  --json "$OUT/device_pipeline.json"
echo "device check done: $OUT"
