#!/usr/bin/env bash
# Run the prepared GPU check on a lent H200 (python3 there has torch 2.11 CUDA 13, triton 3.6; no internet).
# Usage from the repository root:  bash benchmarks/gpu_check.sh [--quick] [--engine] [--skip-tests]
# Results: printed table + $OUT/gpu_check.json (when OUT is set). Keep the call under 5 minutes.
# The device's python3 lacks llguidance, which the engine imports: first, on this machine,
#   bash benchmarks/gpu_check.sh --prepare      # copies .venv's llguidance (an abi3 wheel) to benchmarks/out/pydeps
# and pass `carry: ["benchmarks/out/pydeps"]` to the device run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--prepare" ]]; then
  site=$(.venv/bin/python -c "import llguidance, pathlib; print(pathlib.Path(llguidance.__file__).parents[1])")
  mkdir -p benchmarks/out/pydeps
  cp -r "$site"/llguidance "$site"/llguidance-*.dist-info benchmarks/out/pydeps/
  echo "benchmarks/out/pydeps ready: carry it to the device"
  exit 0
fi
export PYTHONPATH="$PWD/benchmarks/out/pydeps${PYTHONPATH:+:$PYTHONPATH}"
export CONVEYOR_CUDA_BUILD_DIR="${CONVEYOR_CUDA_BUILD_DIR:-/tmp/conveyor_cuda_build}"
export MAX_JOBS="${MAX_JOBS:-16}"
unset TRITON_INTERPRET  # compiled triton on the GPU, never the interpreter
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv || true
exec timeout 290 python3 -m benchmarks.gpu_check "$@"  # a module: the root is on sys.path
