#!/usr/bin/env bash
# second call, 2026-12-04: the exit fix (69b1e4dd) on a GPU, the profile stage (fixed), goal 7 at 1 in 10
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
start=$(date +%s%N)
el() { echo "$(( ($(date +%s%N) - start) / 1000000 )) ms"; }
# 1. a 3-step run that exits while its kernels compile beside it (empty Triton cache): rc, and its time
export TRITON_CACHE_DIR=$(mktemp -d)
t0=$(date +%s%N)
python3 -m precprof train -m gpt2-small -p bf16 --steps 3 --device cuda --out /tmp/r_cold --no-progress > "$OUT/exit_cold.log" 2>&1
echo "rc=$? wall_ms=$(( ($(date +%s%N) - t0) / 1000000 ))" >> "$OUT/exit_cold.log"
ps aux | grep -c "[t]riton_ahead" >> "$OUT/exit_cold.log"
unset TRITON_CACHE_DIR
echo "exit check done at $(el)"
# 2. the GPU tests of the two files the fix touches, side by side
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_training.py -m gpu > "$OUT/test_training.log" 2>&1 &
p1=$!
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_stats_gpu.py > "$OUT/test_stats_gpu.log" 2>&1 &
p2=$!
wait $p1; echo "rc=$?" >> "$OUT/test_training.log"
wait $p2; echo "rc=$?" >> "$OUT/test_stats_gpu.log"
echo "tests done at $(el)"
# 3. where a sampled step's device time goes (the profile stage)
timeout 150 python3 bench/gpu_validate.py --budget-s 120 --stages env,profile,syncs --out "$OUT/gpu_validate_profile.json" > "$OUT/profile.log" 2>&1
echo "rc=$?" >> "$OUT/profile.log"
echo "profile done at $(el)"
# 4. goal 7: a sampled step at 1 in 10 against every step, 16 sampled steps at 1 in 10
timeout 170 python3 bench/overhead.py --configs baseline,precprof_1,precprof_10 --blocks 4 --steps 40 --out "$OUT/overhead_10.json" > "$OUT/overhead_10.log" 2>&1
echo "rc=$?" >> "$OUT/overhead_10.log"
echo "all done at $(el)"
