#!/usr/bin/env bash
# Runs `pytest -m gpu` on the GPU host split over its GPUs, so the whole suite fits in one call.
# From the project root, after `source .gpu/env.sh`: bash tools/gpu_suite.sh [seconds]
# Each group's log lands in $OUT (or /tmp/gpu_suite); the groups are balanced by measured run time
# (CuTe DSL compiles dominate), and test_multi_gpu takes two GPUs of its own when there are four.
set -uo pipefail
limit=${1:-540}
out=${OUT:-/tmp/gpu_suite}
mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l)

# Every test file lands in exactly one group (directories with --ignore), so a new GPU test is not left out.
declare -a groups=(
  "tests/cute_kernels/test_w4a16_gpu.py"
  "tests/cute_kernels --ignore=tests/cute_kernels/test_w4a16_gpu.py"
  "tests/lowering --ignore=tests/lowering/test_multi_gpu.py tests/moe_ops/test_numerics.py"
  "tests --ignore=tests/cute_kernels --ignore=tests/lowering --ignore=tests/moe_ops/test_numerics.py"
)
# Fewer GPUs than groups: the groups share them round-robin.
pids=()
for i in "${!groups[@]}"; do
  gpu=$((i % ngpu))
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES=$gpu timeout "$limit" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider \
    ${groups[$i]} > "$out/group$i.log" 2>&1 &
  pids+=($!)
done
if [ "$ngpu" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=$((ngpu - 2)),$((ngpu - 1)) timeout "$limit" python3 -m pytest -m gpu -q -rfE \
    -p no:cacheprovider tests/lowering/test_multi_gpu.py > "$out/multi_gpu.log" 2>&1 &
  pids+=($!)
fi
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
for f in "$out"/*.log; do echo "== $f"; tail -n 15 "$f"; done
exit $status
