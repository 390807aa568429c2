#!/usr/bin/env bash
# Does `emapg compare --jobs 2` finish a comparison sooner than one run at a time on this machine?
# Runs the quick comparison (GRPO vs EMA-PG, one seed, 2 runs) both ways, back to back, in one
# invocation, and prints the wall time of each. Run it on an otherwise idle machine.
#   bash bench/compare_jobs.sh [OUT_DIR]      # ~15 min on 2 CPU cores
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/compare-jobs}
emapg=${EMAPG:-.venv/bin/emapg}
rm -rf "$out"; mkdir -p "$out"
for jobs in 1 2; do
  start=$(date +%s)
  "$emapg" compare --spec bench/compare.yaml --out "$out/jobs$jobs" --quick --jobs "$jobs" > "$out/jobs$jobs.log" 2>&1
  end=$(date +%s)
  echo "jobs=$jobs wall_seconds=$((end - start))" | tee -a "$out/times.txt"
done
