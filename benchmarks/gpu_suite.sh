#!/usr/bin/env bash
# One prepared GPU validation run, under 10 minutes on one CUDA GPU. Results go to $OUT/gpu when $OUT is set (a
# remote runner's output folder), else to benchmarks/results/gpu/, with the device name.
#
# Where the machine lacks deepspeed and cannot reach a package registry, build the wheels on a machine that can, from
# the project root (deepspeed is pure Python; the others are what a Python 3.12 machine with torch usually lacks):
#   python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions
# then copy .whl/ along with the tree; this script installs them.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:+$OUT/gpu}"
RESULTS="${RESULTS:-benchmarks/results/gpu}"
mkdir -p "$RESULTS"

if ! python3 -c "import deepspeed" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
    else
        echo "deepspeed is not installed and there is no .whl/ folder; see the comment at the top" >&2
        exit 1
    fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONWARNINGS=ignore

{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, triton, deepspeed, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'deepspeed', deepspeed.__version__, 'lightning', lightning.__version__)"
    date -u
} > "$RESULTS/device.txt" 2>&1

status=0
step() {  # name, time limit (s), command...
    local name=$1 limit=$2
    shift 2
    echo "== $name" >&2
    timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1 || { echo "$name failed (see $RESULTS/$name.log)" >&2; status=1; }
}
step gpu_tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_triton_kernel.py tests/test_adamw.py tests/test_gpu.py
step optimizer_step 100 python3 benchmarks/optimizer_step.py --out "$RESULTS"
step memory 120 python3 benchmarks/memory.py --world-size 1 --out "$RESULTS"
step mmap_states 90 python3 benchmarks/mmap_states.py --out "$RESULTS"
step gpt_throughput 130 python3 benchmarks/gpt_throughput.py --out "$RESULTS"
ls -l "$RESULTS" >&2
exit $status
