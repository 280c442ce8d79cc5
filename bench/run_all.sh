#!/usr/bin/env bash
# Every CPU benchmark behind bench/RESULTS.md, in one go, on a quiet machine
# (they compare ratios measured in one run, but a busy neighbour skews them).
#   bash bench/run_all.sh [OUT_DIR]          (about 30 minutes with the 10-minute soak;
#                                             SOAK_MINUTES=0 skips it)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${1:-bench/out}
B=.venv/bin
mkdir -p "$OUT"
$B/physis-profile --model tiny-wam --json config/profiles/tiny-wam.cpu.json
$B/physis-profile --model base-wam --repeats 5 --json "$OUT/profile_base-wam.json"
$B/physis-bench pipeline --model tiny-wam --workers 2 --plans sequential,step,block,stage --chunks 200 --verify \
  --json "$OUT/pipeline_tiny-wam_w2.json" --plot "$OUT/pipeline_tiny-wam_w2.png"
$B/physis-bench pipeline --model tiny-wam --workers 3 --plans step,block,stage --chunks 150 --no-parallel-limit \
  --json "$OUT/pipeline_tiny-wam_w3.json"
for W in 1 2; do  # profiled afresh before every run: the planner's prediction must see this minute's machine
  $B/physis-bench timeshare --model tiny-wam --workers $W --repeats 4 --json "$OUT/timeshare_tiny-wam_w$W.json"
done
$B/physis-bench timeshare --model base-wam --workers 1 --chunks 40 --repeats 2 --json "$OUT/timeshare_base-wam_w1.json"
$B/physis-bench streams --json "$OUT/streams_tiny-wam_w2.json" || true  # exit 1 = an SLO missed: recorded
$B/physis-bench ros --json "$OUT/ros.json"
$B/physis-sim --scenario report24 --json "$OUT/sim_report24.json"
$B/physis-bench hop --json "$OUT/hop.json" --plot "$OUT/hop.png"   # about 25 s
$B/physis-bench history-quality --json "$OUT/history_quality.json" --plot "$OUT/history_quality.png"   # about 70 s
[ "${SOAK_MINUTES:-10}" = 0 ] && exit 0
$B/physis-bench soak --minutes "${SOAK_MINUTES:-10}" --json "$OUT/soak.json" --plot "$OUT/soak.png"
