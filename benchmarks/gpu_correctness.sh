#!/usr/bin/env bash
# The correctness half of a GPU run (under 5 minutes on one CUDA GPU): the GPU-marked tests only (the Triton kernel on
# CUDA against the PyTorch path, the Trainer and Fabric strategies, the plain-DeepSpeed front end, the Hugging Face
# Trainer and Accelerate on one GPU, with in-memory and file-backed states, gradient release against the step, the peak
# meter's headroom that gather_cache="auto" decides by).
# Nothing here builds the C++ CPU loop. Run it before benchmarks/gpu_performance.sh; results and logs in $OUT/gpu (or
# benchmarks/results/gpu).
source "$(dirname "$0")/_gpu_common.sh"
# One test per worker (the machine has 16 cores; 2 workers taking whole files ran past 260 s on an H200, and a run cut
# at its limit prints no failures): each test under its own limit (pytest-timeout, in the CUDA image), so a hung one
# fails and the summary is printed.
# The 8-bit moments' tests first (they failed on the last GPU run; their CPU reference was fixed since).
limits=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout 120")
step gpu_tests 200 python3 -m pytest -p no:cacheprovider -m gpu -n 8 --dist load $limits -rfE --tb=short \
    tests/test_int8_states.py tests/test_triton_kernel.py tests/test_gpu.py tests/test_memory.py tests/test_family.py \
    tests/test_optimizer_api.py
finish
