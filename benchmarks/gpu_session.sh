#!/usr/bin/env bash
# One lease, one command: the correctness half, then the performance half with what is left of GPU_DEADLINE_S
# (default 520 s), every log and result packed into $OUT/gpu.tgz (the device tool returns few files; one archive
# holds them all). Unpack into benchmarks/results/gpu/ and commit it with the device record.
#   bash benchmarks/gpu_session.sh            # on the GPU machine
#   bash benchmarks/gpu_session.sh --dry-run  # here, before a lease: every step's command checked on the CPU (the
#                                             # benchmarks parse and print their plan, the GPU tests are collected)
set -uo pipefail
if [ "${1:-}" = "--dry-run" ]; then export GPU_DRY_RUN=1; fi
cd "$(dirname "$0")/.."
work=$(mktemp -d)
# A dry run without $OUT leaves its archive in the temporary folder, not among the results.
if [ "${GPU_DRY_RUN:-0}" = 1 ]; then dest=${OUT:-$work}; else dest=${OUT:-benchmarks/results}; fi
mkdir -p "$dest"
total=${GPU_DEADLINE_S:-520}
start=$SECONDS
OUT=$work GPU_DEADLINE_S=$total bash benchmarks/gpu_correctness.sh
ok_correct=$?
OUT=$work GPU_DEADLINE_S=$((total - (SECONDS - start))) bash benchmarks/gpu_performance.sh
ok_perf=$?
echo "correctness exit $ok_correct, performance exit $ok_perf, $((SECONDS - start)) s" | tee "$work/gpu/session.txt"
tar czf "$dest/gpu.tgz" -C "$work" gpu && echo "packed into $dest/gpu.tgz"
exit $((ok_correct || ok_perf))
