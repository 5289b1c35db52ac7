#!/bin/sh
# The first run on a CUDA GPU (about 8 minutes on one H200): the CUDA tests, which stop at the first
# kernel that disagrees with its reference, then every kernel benchmark, which checks parity again
# before it times anything, then the parallel training check over the GPUs present (parity of each
# layout with one process, tokens/s, peak memory against zoo describe --parallel; capped at 3 minutes).
# Writes OUT/pytest.txt, OUT/gpu_kernels.json and OUT/gpu_kernels.md (the README's table),
# OUT/gpu_training.json and OUT/gpu_training.md.
#
#     sh benchmarks/gpu_check.sh [OUT]        # OUT defaults to gpu-check/
set -eu
cd "$(dirname "$0")/.."
out=${1:-gpu-check}
mkdir -p "$out"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: nothing to check')"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/device.txt" || true
# The interpreter off (the CPU tests turn it on): the CUDA tests only (kernels, the FP8 product).
if ! TRITON_INTERPRET=0 python -m pytest -x -q -m cuda tests/kernels/test_kernels_cuda.py tests/kernels/test_kernels_moe.py tests/formats/test_fp8_keep.py > "$out/pytest.txt" 2>&1; then
    cat "$out/pytest.txt"
    echo "a kernel disagrees with its reference on this GPU: fix it before measuring (nothing was timed)" >&2
    exit 1
fi
cat "$out/pytest.txt"
TRITON_INTERPRET=0 python benchmarks/gpu_kernels.py --repeats 10 --json "$out/gpu_kernels.json" --markdown "$out/gpu_kernels.md"
TRITON_INTERPRET=0 timeout 180 python benchmarks/gpu_training.py --steps 3 --json "$out/gpu_training.json" \
    --markdown "$out/gpu_training.md" > "$out/gpu_training.txt" 2>&1 || echo "the training check failed: see $out/gpu_training.txt" >&2
echo "done: $out/gpu_kernels.md $out/gpu_training.md"
