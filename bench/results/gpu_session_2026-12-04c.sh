#!/usr/bin/env bash
# third call, 2026-12-04: the row kernel's window from the row's hint (8ddb5bf), on a GPU
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s%N)
el() { echo "$(( ($(date +%s%N) - start) / 1000000 )) ms"; }
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_stats_gpu.py > "$OUT/test_stats_gpu.log" 2>&1
echo "rc=$?" >> "$OUT/test_stats_gpu.log"; echo "tests done at $(el)"
timeout 70 python3 bench/gpu_validate.py --budget-s 60 --stages env,profile --out "$OUT/gpu_validate_profile.json" > "$OUT/profile.log" 2>&1
echo "rc=$?" >> "$OUT/profile.log"; echo "profile done at $(el)"
timeout 100 python3 bench/overhead.py --configs baseline,precprof_1,precprof_1_noblocks --blocks 3 --steps 10 --out "$OUT/overhead.json" > "$OUT/overhead.log" 2>&1
echo "rc=$?" >> "$OUT/overhead.log"; echo "all done at $(el)"
tail -3 "$OUT/test_stats_gpu.log"; tail -6 "$OUT/overhead.log"
