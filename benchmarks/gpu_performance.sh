#!/usr/bin/env bash
# The performance half of a GPU run (under 4 minutes on one CUDA GPU), after benchmarks/gpu_correctness.sh: the
# optimizer step against a device copy and torch's fused AdamW, measured memory, states in files against in-memory
# states and the disk, GPT tokens/s and peak memory against Lightning's DeepSpeedStrategy with bf16-mixed.
source "$(dirname "$0")/_gpu_common.sh"
step optimizer_step 60 python3 benchmarks/optimizer_step.py --out "$RESULTS"
step memory 60 python3 benchmarks/memory.py --world-size 1 --out "$RESULTS"
step mmap_states 45 python3 benchmarks/mmap_states.py --quick --out "$RESULTS"
step gpt_throughput 65 python3 benchmarks/gpt_throughput.py --out "$RESULTS"
finish
