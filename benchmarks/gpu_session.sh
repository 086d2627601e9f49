#!/usr/bin/env bash
# One lease, one command: the correctness half, then the performance half with what is left of GPU_DEADLINE_S
# (default 560 s), every log and result packed into $OUT/gpu.tgz (the device tool returns few files; one archive
# holds them all). Unpack into benchmarks/results/gpu/ and commit it with the device record.
set -uo pipefail
cd "$(dirname "$0")/.."
dest=${OUT:-benchmarks/results}
work=$(mktemp -d)
mkdir -p "$dest"
total=${GPU_DEADLINE_S:-560}
start=$SECONDS
OUT=$work GPU_DEADLINE_S=$total bash benchmarks/gpu_correctness.sh
ok_correct=$?
OUT=$work GPU_DEADLINE_S=$((total - (SECONDS - start))) bash benchmarks/gpu_performance.sh
ok_perf=$?
echo "correctness exit $ok_correct, performance exit $ok_perf, $((SECONDS - start)) s" | tee "$work/gpu/session.txt"
tar czf "$dest/gpu.tgz" -C "$work" gpu
exit $((ok_correct || ok_perf))
