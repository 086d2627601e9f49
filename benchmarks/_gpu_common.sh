# Sourced by gpu_correctness.sh and gpu_performance.sh: results folder, deepspeed from .whl/ where no registry is
# reachable, the device record, and `step NAME LIMIT_S COMMAND...`, which runs each step under its own time limit and
# prints its time; `finish` prints the total and exits with 1 if any step failed.
#
# Where the machine lacks deepspeed (or torchdata, for the GPT example's data) and cannot reach a package registry,
# build the wheels on a machine that can, from the project root: `../shared/gpu/wheels.sh .whl` where that script
# exists (then add torchdata: `python3 -m pip download -q --no-deps -d .whl torchdata==0.11.0`), or
#   python3 -m pip wheel -q --no-deps -w .whl deepspeed==0.19.8
#   python3 -m pip download -q --no-deps -d .whl torchdata==0.11.0
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions psutil einops \
#       msgpack ninja py-cpuinfo
# and for the Hugging Face Trainer and Accelerate tests (skipped without them):
#   python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64 \
#       -d .whl transformers==5.24.0 accelerate==1.15.0 tokenizers huggingface-hub regex safetensors hf-xet httpx2 \
#       httpcore2 h11 anyio typer shellingham annotated-doc truststore
# then copy .whl/ along with the tree (it is git-ignored: name it in the runner's carry list).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
RESULTS="${OUT:+$OUT/gpu}"
RESULTS="${RESULTS:-benchmarks/results/gpu}"
mkdir -p "$RESULTS"

if ! python3 -c "import deepspeed, torchdata" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
        export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
    else
        echo "deepspeed or torchdata is not installed and there is no .whl/ folder; see the comment at the top of $0" >&2
        exit 1
    fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONWARNINGS=ignore

# GPU_DRY_RUN=1 (gpu_session.sh --dry-run): every step's command checked on this machine, nothing measured: the
# benchmarks parse their arguments and print their plan (--dry-run), the GPU tests are collected, not run.
DRY_RUN=${GPU_DRY_RUN:-0}
{
    if [ "$DRY_RUN" = 1 ]; then
        echo "dry run on $(hostname): no GPU used, nothing measured"
    else
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        python3 -c "import torch, triton, deepspeed, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'deepspeed', deepspeed.__version__, 'lightning', lightning.__version__)"
    fi
    date -u
} > "$RESULTS/device.txt" 2>&1

status=0
start_all=$SECONDS
# GPU_DEADLINE_S: seconds left for this script as a whole (the lease is short): each step's limit is cut to what is
# left, and a step with under 20 s left is skipped and reported as such.
deadline=$((SECONDS + ${GPU_DEADLINE_S:-100000}))
step() {  # name, time limit (s), command...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    local left=$((deadline - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "== $name: SKIPPED, ${left} s left of GPU_DEADLINE_S" >&2
        status=1
        return
    fi
    if [ "$limit" -gt "$left" ]; then limit=$left; fi
    if [ "$DRY_RUN" = 1 ]; then
        if [ "$2" = "-m" ] && [ "$3" = "pytest" ]; then set -- "$@" --collect-only -q -n 0; else set -- "$@" --dry-run; fi
    fi
    timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
    local rc=$?
    local took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        echo "== $name: ok in ${took} s (limit ${limit} s)" >&2
    else
        echo "== $name: FAILED (exit $rc) after ${took} s (limit ${limit} s); see $RESULTS/$name.log" >&2
        status=1
    fi
}
finish() {
    echo "== total $((SECONDS - start_all)) s; results in $RESULTS" >&2
    exit $status
}
