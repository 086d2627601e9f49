#!/usr/bin/env bash
# The performance half of a GPU run (under 9 minutes on one CUDA GPU), after benchmarks/gpu_correctness.sh: the
# optimizer step against a device copy and torch's fused AdamW, measured memory, states in files against in-memory
# states and the disk, GPT-2 124M tokens/s beside DeepSpeed's bf16 mixed precision and FSDP2, and the largest GPT
# that trains in 8 GiB for DeepSpeed's bf16 mixed precision, this strategy and its 8-bit moments. In order of worth:
# under a GPU_DEADLINE_S that runs out, the later steps are cut or skipped.
source "$(dirname "$0")/_gpu_common.sh"
step optimizer_step 60 python3 benchmarks/optimizer_step.py --no-torch-path --out "$RESULTS"
step memory 60 python3 benchmarks/memory.py --world-size 1 --out "$RESULTS"
step gpt_throughput 150 python3 benchmarks/gpt_throughput.py --device cuda --out "$RESULTS" \
    --arms ds_bf16_mixed ds_bf16_flags pure_bf16 pure_bf16_int8 fsdp2_torchao_sr
step mmap_states 45 python3 benchmarks/mmap_states.py --quick --out "$RESULTS"
step largest_model 200 python3 benchmarks/largest_model.py --device cuda --budget-gib 8 --out "$RESULTS" \
    --arms ds_bf16_mixed pure_bf16 pure_bf16_int8
finish
