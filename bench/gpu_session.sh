#!/usr/bin/env bash
# One prepared call on a lent GPU (the device tool's `run`, from the repository root, with `carry: [".whl"]`
# when torchao's wheel is wanted): gpu_validate's stages, the GPU tests among them (every GPU test file, one
# process each), all written under $OUT. Its own time stays under BUDGET_S (default 480 s) so that a 580 s call
# leaves room; on 2026-12-04 the defaults took 342 s of an H200.
#
#   STAGES   gpu_validate's stages (default: env,overhead,kernels,host,profile,syncs,first_step,tests,memory_cost)
#   TESTS    pytest -k expression for GPU tests run before the stages (default "": none; the tests stage runs all)
#   BUDGET_S seconds for the whole script
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-480}
STAGES=${STAGES:-env,overhead,kernels,host,profile,syncs,first_step,tests,memory_cost}
TESTS=${TESTS-}
start=$(date +%s)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    > "$OUT/pip.log" 2>&1 && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
if [ -n "$TESTS" ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_stats_gpu.py tests/test_triton_block.py \
    -k "$TESTS" > "$OUT/tests.log" 2>&1
  echo "tests rc=$?" >> "$OUT/tests.log"
fi
left=$(( BUDGET_S - ($(date +%s) - start) ))
timeout $(( left + 30 )) python3 bench/gpu_validate.py --budget-s $(( left - 20 )) --stages "$STAGES" \
  --out "$OUT/gpu_validate.json" > "$OUT/validate.log" 2>&1
echo "gpu_validate rc=$? after $(( $(date +%s) - start )) s" >> "$OUT/validate.log"
tail -5 "$OUT/validate.log"
