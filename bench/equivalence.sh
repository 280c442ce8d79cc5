#!/usr/bin/env bash
# The equivalence matrix's large corners, which the test suite leaves out to stay within its time budget
# (tests/runtime/test_engine.py runs every plan on 2 and 3 workers): every plan on 4 workers for both tiny
# models, and every plan with each hidden-state transport on 3 workers, each chunk compared bit for bit with
# the sequential reference (physis-bench pipeline --verify; exit 1 on any difference). About 2 minutes on
# 2 cores.
#   bash bench/equivalence.sh [OUT_DIR]        (default bench/out; JSON per run)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-bench/out}
B=.venv/bin
mkdir -p "$OUT"
for MODEL in tiny-wam tiny-acwm; do
  $B/physis-bench pipeline --model $MODEL --workers 4 --plans step,block,stage --chunks 13 --repeats 1 \
    --verify --no-parallel-limit --json "$OUT/equivalence_${MODEL}_w4.json"
done
$B/physis-bench pipeline --model tiny-wam --workers 3 --plans step,block,stage --chunks 13 --repeats 1 \
  --transport zmq,torch,shm --verify --no-parallel-limit --json "$OUT/equivalence_transports_w3.json"
echo "equivalence: every corner bit-identical to the reference" >&2
