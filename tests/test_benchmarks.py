"""The prepared GPU session (benchmarks/gpu_session.sh) checked here, before any lease: a dry run on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).parents[1]


def test_the_gpu_session_dry_run_checks_every_step_on_the_cpu(tmp_path):
    # python3 is this environment's interpreter, as on the GPU machine; every benchmark parses its arguments and prints
    # its plan, the GPU tests are collected; the archive holds every step's log.
    env = {**os.environ, "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_session.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = ["gpu_tests", "optimizer_step", "gpt_throughput_1b", "largest_model", "mmap_states", "memory"]
    assert all(f"== {step}: ok in" in proc.stderr for step in steps), proc.stderr
    with tarfile.open(tmp_path / "gpu.tgz") as archive:
        archive.extractall(tmp_path / "unpacked", filter="data")
    logs = {step: (tmp_path / "unpacked" / "gpu" / f"{step}.log").read_text() for step in steps}
    assert "tests collected" in logs["gpu_tests"] and "test_int8_states.py::" in logs["gpu_tests"]
    assert "test_family.py::" in logs["gpu_tests"]  # Lion's and SGD's kernels on the device too
    assert "flat 2^27" in logs["optimizer_step"] and "on cuda" in logs["optimizer_step"]
    params = int(logs["gpt_throughput_1b"].split(" parameters")[0].split()[-1].replace(",", ""))
    assert params >= 1_000_000_000 and "fsdp2_bf16" in logs["gpt_throughput_1b"]
    assert all(logs[step].startswith("dry run: ") for step in steps[1:])
    assert "dry run" in (tmp_path / "unpacked" / "gpu" / "device.txt").read_text()
    assert "correctness exit 0, performance exit 0" in (tmp_path / "unpacked" / "gpu" / "session.txt").read_text()
