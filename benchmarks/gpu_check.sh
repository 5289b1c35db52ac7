#!/bin/sh
# The first hour on a CUDA GPU, planned for a lent machine as it is: python3 with torch, Triton and
# transformers already there, nothing reachable, at most 10 minutes a command and 15 in all (the
# machine's start, a minute or two, included). Two calls:
#
#     sh benchmarks/gpu_check.sh --part 1 OUT   # under 9 minutes: environment, install, CUDA tests,
#                                                #   the targets, the anchors (fla, Liger)
#     sh benchmarks/gpu_check.sh --part 2 OUT   # under 4 minutes: the other kernels, the training check
#     sh benchmarks/gpu_check.sh --dry-run OUT  # on the CPU: parses, finds its files, installs offline
#
# Each stage runs under its own time limit and writes its results as it goes (OUT/check.log holds
# every stage's output; the benchmarks rewrite their JSON and markdown after each kernel), so a
# stage stopped by its limit still returns what it measured, and the next stage runs. The CUDA
# tests run on several workers and list every failure. The exit status is the number of stages
# that failed. Files written (at most 7 a part): env.txt, check.log, pytest.txt, targets.json,
# targets.md, anchors.json, anchors.md (part 1); extras.json, extras.md, training.md (part 2).
#
# The anchors' wheels (pure Python) travel in .whl/, an ignored folder, fetched beforehand on a
# machine with PyPI: see benchmarks/gpu_vs_anchors.py.
set -u
cd "$(dirname "$0")/.."
part=1 dry=0
while [ $# -gt 0 ]; do
    case "$1" in
        --part) part=$2; shift 2 ;;
        --dry-run) dry=1; shift ;;
        -*) echo "gpu_check.sh: unknown option $1 (--part 1|2, --dry-run)" >&2; exit 2 ;;
        *) break ;;
    esac
done
case "$part" in 1|2) ;; *) echo "gpu_check.sh: --part is 1 or 2, not $part" >&2; exit 2 ;; esac
out=${1:-gpu-check}
mkdir -p "$out"
out=$(cd "$out" && pwd)
PY=${PYTHON:-python3}
log="$out/check.log"
failed=0
: > "$log"

say() { echo "$*" | tee -a "$log"; }

# stage NAME SECONDS COMMAND...: runs COMMAND under a time limit, its output appended to the log
stage() {
    name=$1 limit=$2; shift 2
    say "== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    took=$(( $(date +%s) - start ))
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        say "== $name: stopped at its limit after ${took}s (what it wrote so far is kept)"
        failed=$((failed + 1))
    elif [ $rc -ne 0 ]; then
        say "== $name: FAILED (exit $rc) after ${took}s"
        failed=$((failed + 1))
    else
        say "== $name: done in ${took}s"
    fi
    return $rc
}

for f in pyproject.toml tests/kernels/test_kernels_cuda.py tests/kernels/test_kernels_moe.py tests/formats/test_fp8_keep.py \
         benchmarks/gpu_kernels.py benchmarks/gpu_training.py benchmarks/gpu_vs_anchors.py; do
    [ -f "$f" ] || { echo "gpu_check.sh: $f is missing: run it from a whole checkout" >&2; exit 2; }
done

# -- the environment, first -------------------------------------------------------------------
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 || echo "nvidia-smi: none"
    "$PY" - <<'EOF' 2>&1
import importlib, platform, sys
print("python", sys.version.split()[0], sys.executable, platform.machine())
for name in ("torch", "triton", "transformers", "accelerate", "safetensors", "pluggy", "pytest", "xdist"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:
        print(name, "MISSING", type(e).__name__)
import torch
print("cuda", torch.version.cuda, "available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", round(p.total_memory / 2**30), "GiB")
EOF
    nproc 2>&1 | sed 's/^/cpus /'
} > "$out/env.txt" 2>&1
cat "$out/env.txt" | tee -a "$log"

# -- zoo, installed offline from this tree (never torch: --no-deps) ---------------------------------
if [ $dry -eq 1 ]; then
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    # a throwaway target and no index: what the lent machine will do, without touching this environment
    if ! stage install 120 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index --target "$tmp/site" .; then
        echo "gpu_check.sh: zoo could not be installed offline (see $log): nothing was checked" >&2
        exit 3
    fi
    stage import 60 sh -c "cd '$tmp' && PYTHONPATH='$tmp/site' '$PY' -c 'import zoo.components, zoo.families, zoo.components.kernels; print(\"zoo imports from\", zoo.__file__)'" || exit 3
    stage collect 120 env TRITON_INTERPRET=0 "$PY" -m pytest -q --collect-only -m cuda -p no:cacheprovider \
        tests/kernels/test_kernels_cuda.py tests/kernels/test_kernels_moe.py tests/formats/test_fp8_keep.py
    stage anchors 120 "$PY" benchmarks/gpu_vs_anchors.py --dry-run --json "$out/anchors.json"
    say "dry run: $failed stage(s) failed"
    exit $failed
fi

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check.sh: no CUDA device: nothing to check (--dry-run checks the script on the CPU)" >&2
    exit 1
fi
if ! stage install 60 "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . || \
   ! (cd /tmp && "$PY" -c "import zoo.components, zoo.families" >> "$log" 2>&1); then
    echo "gpu_check.sh: zoo could not be installed offline from this tree (pip install --no-deps --no-build-isolation --no-index -e .): see $log; nothing was measured" >&2
    exit 3
fi
if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then  # the anchors, carried
    stage wheels 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/anchors .whl/*.whl
    export PYTHONPATH="/tmp/anchors${PYTHONPATH:+:$PYTHONPATH}"
fi
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
workers=$(( $(nproc) > 12 ? 12 : $(nproc) ))

if [ "$part" = 1 ]; then
    # The CUDA tests: each Triton build takes about 11 CPU seconds, so they are spread over workers;
    # no -x: every failure is listed.
    stage cuda-tests 210 "$PY" -m pytest -q -rf -m cuda -n "$workers" -p no:cacheprovider \
        tests/kernels/test_kernels_cuda.py tests/kernels/test_kernels_moe.py tests/formats/test_fp8_keep.py
    grep -E "passed|failed|FAILED|ERROR|error" "$log" | tail -40 > "$out/pytest.txt"
    # The targets (RMSNorm >= 3x eager; fused loss <= 0.25x eager's memory at 128k; training step >= 1.2x)
    stage targets 150 "$PY" benchmarks/gpu_kernels.py --only rmsnorm,loss,train --repeats 10 \
        --json "$out/targets.json" --markdown "$out/targets.md"
    stage anchors 90 "$PY" benchmarks/gpu_vs_anchors.py --json "$out/anchors.json" --markdown "$out/anchors.md"
else
    stage extras 150 "$PY" benchmarks/gpu_kernels.py --only layernorm,rope,swiglu,attention,scalar_decay,gated_delta \
        --repeats 10 --json "$out/extras.json" --markdown "$out/extras.md"
    stage training 60 "$PY" benchmarks/gpu_training.py --steps 3 --layouts one --markdown "$out/training.md"
fi
say "part $part: $failed stage(s) failed; results in $out"
exit $failed
