"""The memory planner: its arithmetic, its command, and agreement with benchmarks/memory.py's measurements."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_pure_bf16.memory import MODEL_STATE_BYTES, STATE_FILE_BYTES
from lightning_pure_bf16.plan import GIB, plan
from tests.strategy_runs import _env

ROOT = Path(__file__).resolve().parents[1]


def test_70b_on_8x80gb():
    p = plan(70e9, 8, 80)
    assert p.bytes_per_param == {
        "pure_bf16_stochastic": 8.0,
        "pure_bf16_kahan": 10.0,
        "pure_bf16_int8": 6.0 + 4 / 128,
        "pure_bf16_int8_kahan": 7.0 + 4 / 128,
        "deepspeed_bf16_master": 10.0,
        "deepspeed_bf16_mixed": 16.0,
        "pure_bf16_mmap": 4.0,
        "pure_bf16_kahan_mmap": 4.0,
        "pure_bf16_release": 6.0,
        "pure_bf16_kahan_release": 8.0,
        "pure_bf16_int8_release": 4.0 + 4 / 128,
        "pure_bf16_int8_kahan_release": 5.0 + 4 / 128,
        "pure_bf16_mmap_release": 2.0,
        "pure_bf16_kahan_mmap_release": 2.0,
        "pure_bf16_int8_mmap_release": 2.0,
        "pure_bf16_int8_kahan_mmap_release": 2.0,
        # Lion and SGD: one state per element (none for SGD without momentum).
        "pure_bf16_lion": 6.0,
        "pure_bf16_lion_kahan": 8.0,
        "pure_bf16_lion_int8": 5.0 + 2 / 128,
        "pure_bf16_lion_release": 4.0,
        "pure_bf16_lion_int8_release": 3.0 + 2 / 128,
        "pure_bf16_sgd_momentum": 6.0,
        "pure_bf16_sgd_momentum_int8_release": 3.0 + 2 / 128,
        "pure_bf16_sgd": 4.0,
        # Adafactor: no state per element; Muon: one.
        "pure_bf16_adafactor": 4.0,
        "pure_bf16_adafactor_kahan": 6.0,
        "pure_bf16_muon": 6.0,
    }
    assert p.per_gpu_model_state_gib["pure_bf16_stochastic"] == pytest.approx(70e9 * 8 / 8 / GIB)
    # With the default margin (15%, 12 GiB for activations) 8 bytes/param is just over 80 GiB; 8-bit moments fit.
    assert p.fits["pure_bf16_int8"] and not p.fits["pure_bf16_stochastic"] and not p.fits["deepspeed_bf16_mixed"]
    # An 80-layer model whose activations take 8 GiB fits at 8 bytes/param; DeepSpeed's bf16 mixed never does.
    tight = plan(70e9, 8, 80, layers=80, activation_margin_gib=8)
    assert tight.fits["pure_bf16_stochastic"] and not tight.fits["deepspeed_bf16_mixed"]


def test_70b_trains_on_8x40gb_with_the_weights_alone_on_the_gpus():
    # Gradient release with the states in files: 2 B/param on the device. With the 80 layers gathered one at a time
    # and the default margin (6 GiB of 40), every such row fits 8 x 40 GB; the mmap preset without release and 8-bit
    # moments with release (4 B/param) do not.
    p = plan(70e9, 8, 40, layers=80, disk_gbps=5.0)
    for config in ("pure_bf16_mmap_release", "pure_bf16_int8_mmap_release", "pure_bf16_kahan_mmap_release"):
        assert p.per_gpu_model_state_gib[config] == pytest.approx(70e9 * 2 / 8 / GIB)
        assert p.fits[config], config
    assert not p.fits["pure_bf16_mmap"] and not p.fits["pure_bf16_int8_release"]
    # The states' traffic per step: 8-bit moments stream about half of what bf16 ones do.
    files = p.state_files_per_node_gib
    assert files["pure_bf16_int8_mmap_release"] == pytest.approx(files["pure_bf16_mmap_release"] * (1 + 2 / 128) / 2)
    assert p.disk_seconds_per_step["pure_bf16_mmap_release"] == pytest.approx(2 * 70e9 * 4 / 5e9)


def test_the_step_and_one_layer_are_counted():
    # DeepSpeed's bf16 mixed step adds a float32 (and a bf16) copy of the sub-group's gradient; this package nothing
    # that grows with the model. One layer's gradients in the backward, and one layer gathered beyond ZeRO-3's
    # live-parameter limit (1e9): fewer, larger layers cost more, twice 2 bytes per parameter of the larger layer.
    a, b = plan(7e9, 8, 80, layers=32, gather_cache="keep"), plan(7e9, 8, 80, layers=8, gather_cache="keep")
    assert b.working_buffers_gib - a.working_buffers_gib == pytest.approx(2 * 2 * 7e9 * (1 / 8 - 1 / 32) / GIB)
    small = plan(0.5e9, 8, 80, layers=2, gather_cache="keep")  # under the limit: the whole model gathered, no more
    assert small.working_buffers_gib == pytest.approx((2 * (0.5e9 + 50_000_000 + 200_000_000) + 2 * 0.5e9 / 2) / GIB)
    mixed = a.per_gpu_total_gib["deepspeed_bf16_mixed"] - a.per_gpu_model_state_gib["deepspeed_bf16_mixed"]
    ours = a.per_gpu_total_gib["pure_bf16_stochastic"] - a.per_gpu_model_state_gib["pure_bf16_stochastic"]
    assert mixed - ours == pytest.approx(6 * 7e9 / 8 / GIB)


def test_mmap_states_need_disk_space_and_stream_time():
    p = plan(70e9, 16, 80, gpus_per_node=8, disk_gbps=5.0)
    # 4 B/param on the GPU; the moments (6 B/param with Kahan) on the disk of each node, read and written each step.
    assert p.per_gpu_model_state_gib["pure_bf16_mmap"] == pytest.approx(70e9 * 4 / 16 / GIB)
    assert p.state_files_per_node_gib["pure_bf16_mmap"] == pytest.approx(70e9 * 4 / 16 * 8 / GIB)
    assert p.state_files_per_node_gib["pure_bf16_kahan_mmap"] == pytest.approx(70e9 * 6 / 16 * 8 / GIB)
    assert p.disk_seconds_per_step["pure_bf16_mmap"] == pytest.approx(2 * 70e9 * 4 / 2 / 5e9)
    assert p.disk_seconds_per_step["pure_bf16_stochastic"] is None
    assert p.state_files_per_node_gib["pure_bf16_stochastic"] == 0.0
    assert plan(70e9, 8, 80).disk_seconds_per_step["pure_bf16_mmap"] is None  # no bandwidth given: not estimated


def test_frozen_parameters_hold_only_their_bf16_partition():
    full, half = plan(10e9, 4, 80), plan(10e9, 4, 80, frozen_fraction=0.5)
    expected = (5e9 * 8 + 5e9 * 2) / 4 / GIB
    assert half.per_gpu_model_state_gib["pure_bf16_stochastic"] == pytest.approx(expected)
    assert half.per_gpu_model_state_gib["pure_bf16_stochastic"] < full.per_gpu_model_state_gib["pure_bf16_stochastic"]


def test_margin_decides_fit():
    assert plan(1e9, 1, 16, activation_margin_gib=0).fits["pure_bf16_stochastic"]
    assert not plan(1e9, 1, 16, activation_margin_gib=15).fits["pure_bf16_stochastic"]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--params", "0", "--gpus", "8", "--gpu-memory-gib", "80"], "--params must be a positive"),
        (["--params", "7e9", "--gpus", "0", "--gpu-memory-gib", "80"], "--gpus must be at least 1"),
        (["--params", "7e9", "--gpus", "8", "--gpu-memory-gib", "-1"], "--gpu-memory-gib must be positive"),
        (["--params", "7e9", "--gpus", "8", "--gpu-memory-gib", "80", "--frozen-fraction", "1"], "frozen-fraction"),
        (["--params", "7e9", "--gpus", "8", "--gpu-memory-gib", "80", "--gpus-per-node", "9"], "--gpus-per-node"),
        (["--params", "7e9", "--gpus", "8", "--gpu-memory-gib", "80", "--disk-gbps", "0"], "--disk-gbps must be"),
    ],
)
def test_bad_input_is_an_error(args, match, capsys):
    # In this process (the command line itself runs in test_json_output): exit status 2 and the message.
    from lightning_pure_bf16.plan import main

    assert main(args) == 2 and match in capsys.readouterr().err


def test_json_output():
    cmd = [
        sys.executable,
        "-m",
        "lightning_pure_bf16.plan",
        "--params",
        "70e9",
        "--gpus",
        "8",
        "--gpu-memory-gib",
        "80",
        "--json",
    ]
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    for key in ("bytes_per_param", "per_gpu_model_state_gib", "fits", "state_files_per_node_gib"):
        assert set(out[key]) == set(MODEL_STATE_BYTES)
    assert out["fits"]["pure_bf16_int8"] is True and out["layers"] == 32


def test_with_the_default_gather_cache_one_layer_is_gathered_next_two_and_deepspeeds_rows_keep_every_layer():
    layer, keep = plan(7e9, 8, 80, layers=32), plan(7e9, 8, 80, layers=32, gather_cache="keep")
    assert layer.gather_cache == "auto"  # the default plans one layer: it gathers a second only where it has room
    assert plan(7e9, 8, 80, layers=32, gather_cache="layer").working_buffers_gib == layer.working_buffers_gib
    # keep: the live-parameter limit (1e9) plus one layer gathered; layer: one layer. 2 bytes each.
    assert keep.working_buffers_gib - layer.working_buffers_gib == pytest.approx(2 * 1e9 / GIB)
    assert layer.deepspeed_working_buffers_gib == keep.working_buffers_gib == keep.deepspeed_working_buffers_gib
    for config in ("deepspeed_bf16_mixed", "deepspeed_bf16_master"):
        assert layer.per_gpu_total_gib[config] == keep.per_gpu_total_gib[config]
    ours = layer.per_gpu_total_gib["pure_bf16_stochastic"]
    assert keep.per_gpu_total_gib["pure_bf16_stochastic"] - ours == pytest.approx(2 * 1e9 / GIB)
    # next: the layer in use and the one gathered ahead of it.
    ahead = plan(7e9, 8, 80, layers=32, gather_cache="next")
    assert ahead.working_buffers_gib - layer.working_buffers_gib == pytest.approx(2 * 7e9 / 32 / GIB)
    # auto: gathers ahead only where the memory left at the first step's peak holds it, so it plans as one layer.
    assert plan(7e9, 8, 80, layers=32, gather_cache="auto").working_buffers_gib == layer.working_buffers_gib
    with pytest.raises(ValueError, match="--gather-cache must be one of"):
        plan(7e9, 8, 80, gather_cache="all")


def test_planner_agrees_with_measured_memory(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory.py"), "--quick", "--out", str(tmp_path)]
    subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600, env=_env())
    with open(tmp_path / "memory_quick.csv") as f:
        measured = {row["config"]: row for row in csv.DictReader(f)}
    planned = plan(1e6, 2, 80).bytes_per_param
    assert set(measured) == set(MODEL_STATE_BYTES)
    for config, row in measured.items():
        assert float(row["total"]) == pytest.approx(planned[config], rel=0.05), config
        for category, nbytes in MODEL_STATE_BYTES[config].items():
            assert float(row[category]) == pytest.approx(nbytes, rel=0.05), (config, category)
        assert float(row["state_files"]) == pytest.approx(STATE_FILE_BYTES.get(config, 0), rel=0.05), config
    # 8-bit states, scales included, measured from the live buffers.
    assert float(measured["pure_bf16_int8"]["total"]) <= 6.05
    assert float(measured["pure_bf16_int8_kahan"]["total"]) <= 7.05
    assert measured["pure_bf16_int8"]["dtypes"] == (
        "param bfloat16; grad bfloat16; exp_avg bfloat16, int8; exp_avg_sq bfloat16, uint8"
    )


def test_the_reduce_bucket_enters_the_working_set():
    # The strategies use 5e6-element buckets on the CPU, DeepSpeed's 2e8 elsewhere: the planner counts the one given.
    gpu, cpu = plan(1e9, 2, 80), plan(1e9, 2, 80, reduce_bucket=5_000_000)
    assert gpu.working_buffers_gib - cpu.working_buffers_gib == pytest.approx(2 * (200_000_000 - 5_000_000) / 1024**3)
    assert cpu.per_gpu_total_gib["pure_bf16_stochastic"] < gpu.per_gpu_total_gib["pure_bf16_stochastic"]


def test_planner_predicts_inside_the_measured_brackets_of_the_largest_model_search():
    # benchmarks/results/largest_model.csv: for each arm the largest GPT that trained within 12 GiB on 2 CPU ranks and
    # the first size that did not. The planner's largest size for that budget must lie between them.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from largest_model import PLANNER_CONFIG, planner_largest

    with open(ROOT / "benchmarks" / "results" / "largest_model.csv") as f:
        rows = list(csv.DictReader(f))
    margin = max(float(r["before_model_gib"]) for r in rows)
    # Measured before gather_cache="layer" became the default: with DeepSpeed's cache of gathered layers.
    predicted = planner_largest(12.0, 2, margin, "cpu", layers=4, gather_cache="keep")
    measured = {r["arm"] for r in rows}
    assert len(measured & set(PLANNER_CONFIG)) == 9  # every arm of the planner's configurations searched then
    for arm, config in PLANNER_CONFIG.items():
        if arm not in measured:  # arms added since (other gather_cache settings), measured in their own reports
            continue
        fitted = max(int(r["params"]) for r in rows if r["arm"] == arm and r["fits"] == "True")
        failed = min(
            int(r["params"]) for r in rows if r["arm"] == arm and r["fits"] == "False" and int(r["params"]) > fitted
        )
        assert fitted <= predicted[config] < failed, (arm, fitted, predicted[config], failed)


def test_the_phases_around_the_step_hold_less_than_the_stock_paths_and_agree_with_the_lifecycle_benchmark():
    from lightning_pure_bf16.plan import HOST_PIECE_BYTES, host_phases

    phases = {h.phase: h for h in plan(70e9, 8, 80, layers=80).host_phases}
    assert list(phases) == [
        "construction",
        "load pretrained",
        "steps",
        "checkpoint save",
        "save in HF layout",
        "resume",
        "export",
    ]
    assert all(h.ours_bytes <= h.stock_bytes for h in phases.values())
    assert phases["save in HF layout"].ours_bytes == HOST_PIECE_BYTES
    assert phases["save in HF layout"].stock_bytes == 2 * 70e9  # every 16-bit weight on rank 0
    assert phases["resume"].stock_bytes == 12 * 70e9 / 8  # a rank's float32 master and moments
    with pytest.raises(ValueError, match="--largest-tensor"):
        host_phases(70e9, 8, largest_tensor=0)
    # The same model as benchmarks/lifecycle_memory.py measured (1.0B parameters on 2 CPU ranks): each phase's
    # measured rise within the prediction plus 64 MB of slack where the host is the device too.
    with open(ROOT / "benchmarks" / "results" / "lifecycle_memory.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["arm"] == "pure_bf16"]
    params = int(rows[0]["params"])
    largest = 4 * 2048 * 2048  # the GPT's largest tensor (n_embd 2048): an MLP projection
    predicted = {h.phase: h for h in host_phases(params, 2, layers=20, largest_tensor=largest)}
    slack = 64 * 10**6
    measured = {(r["phase"], r["rank"]): r for r in rows}
    for rank in ("0", "1"):
        for phase in ("load pretrained", "resume"):
            row = measured[(phase, rank)]
            assert int(row["peak_bytes"]) - int(row["start_bytes"]) <= predicted[phase].ours_bytes + slack, phase
    export = int(measured[("export", "")]["peak_bytes"])
    assert export <= predicted["export"].ours_bytes + slack
    z2f = int(measured[("export by zero_to_fp32.py, default 5GB shards", "")]["peak_bytes"])
    assert z2f == pytest.approx(predicted["export"].stock_bytes, rel=0.15)
