#!/usr/bin/env bash
# The device check, one prepared script (about 6 minutes on one H200; under a minute with --device cpu,
# which CI runs as its smoke test: tests/bench/test_device_check.py).
#
#   bash bench/device_check.sh [--device cuda:0|cpu] [OUT_DIR]        (default: cuda:0, bench/out)
#
# It needs the project's venv (make setup). The pinned torch is the CPU wheel: on a GPU machine install
# the CUDA build of the same version into .venv first, e.g.
#   .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
#
# Writes OUT_DIR/device_check.json (physis-bench device: profile of a backbone-shaped preset on the device,
# 1 worker then 2 workers time-sharing it with the stage plan and adaptive batching, per hidden-state
# transport that can pair them there, every chunk checked against the sequential reference computed on
# the device; interval, per-stage time, worker-to-worker hop time, each worker's KV/weight/device memory)
# and OUT_DIR/device_hop.json (physis-bench hop: hop time per transport vs memcpy). MODEL, CHUNKS and
# SIZES override the defaults.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DEVICE=cuda:0
if [ "${1:-}" = "--device" ]; then
  DEVICE=${2:?--device needs a value: cpu or cuda:N}
  shift 2
fi
OUT=${1:-${OUT:-bench/out}}
PY=${PY:-.venv/bin/python}
mkdir -p "$OUT"
if [ "$DEVICE" = cpu ]; then
  MODEL=${MODEL:-tiny-wam}; CHUNKS=${CHUNKS:-16}; SIZES=${SIZES:-64K,1M}; REPEATS=3; HOP_REPEATS=5
else
  MODEL=${MODEL:-wan2.1-1.3b}; CHUNKS=${CHUNKS:-40}; SIZES=${SIZES:-64K,1M,16M,64M}; REPEATS=5; HOP_REPEATS=30
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device_gpu.txt"
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else
    'this torch has no CUDA: install the CUDA build of torch into .venv first (see the top of this script)')"
fi
echo "device check: $MODEL on $DEVICE, $CHUNKS chunks per run -> $OUT" >&2
timeout 420 "$PY" -m physis_ros.cli.bench device --model "$MODEL" --device "$DEVICE" --chunks "$CHUNKS" \
  --profile-repeats "$REPEATS" --json "$OUT/device_check.json"
timeout 120 "$PY" -m physis_ros.cli.bench hop --sizes "$SIZES" --repeats "$HOP_REPEATS" --json "$OUT/device_hop.json"
"$PY" - "$OUT" <<'PYEOF'
import json, sys
out = sys.argv[1]
check = json.load(open(f"{out}/device_check.json"))
hop = json.load(open(f"{out}/device_hop.json"))
check["hop_bench"] = {"hops": hop["hops"], "memcpy": hop["memcpy"], "floor": hop.get("floor", []), "skipped": hop.get("skipped", {})}
json.dump(check, open(f"{out}/device_check.json", "w"), indent=1)
print(json.dumps({"device": check["device"], "equivalent": check["equivalent"],
                  "interval_ms_p50": {f"{r['workers']}w/{r['hops']}": round(r["interval_ms_p50"], 3) for r in check["runs"]},
                  "hop_ms_p50": check["hop_ms_p50_by_transport"]}))
PYEOF
echo "device check done: $OUT/device_check.json" >&2
