#!/usr/bin/env bash
# The performance half of a GPU run (under 6 minutes on one CUDA GPU), after benchmarks/gpu_correctness.sh, in order of
# worth (under a GPU_DEADLINE_S that runs out, the later steps are cut or skipped): the optimizer step at 2^24 and 2^27
# elements and one d=2048 layer beside torch's fused AdamW and a device-to-device copy of the same bytes; tokens/s of a
# 1.2B-parameter GPT on one GPU, this strategy's default beside DeepSpeed ZeRO-3 bf16 mixed, DeepSpeed's own bf16 flags
# and FSDP2 with torch's AdamW on bf16; the largest GPT that trains in 8 GiB for DeepSpeed's bf16 mixed precision, this
# strategy and its 8-bit moments; states in files against in-memory states and the disk; measured memory.
source "$(dirname "$0")/_gpu_common.sh"
step optimizer_step 90 python3 benchmarks/optimizer_step.py --device cuda --no-torch-path --out "$RESULTS"
step gpt_throughput_1b 200 python3 benchmarks/gpt_throughput.py --device cuda --size 1b --out "$RESULTS" \
    --arms pure_bf16 ds_bf16_mixed ds_bf16_flags fsdp2_bf16
step largest_model 150 python3 benchmarks/largest_model.py --device cuda --budget-gib 8 --out "$RESULTS" \
    --arms ds_bf16_mixed pure_bf16 pure_bf16_int8
step mmap_states 45 python3 benchmarks/mmap_states.py --device cuda --quick --out "$RESULTS"
step memory 60 python3 benchmarks/memory.py --device cuda --world-size 1 --out "$RESULTS"
finish
