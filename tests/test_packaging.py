"""The package as a user installs it: the C++ sources of the fused CPU loop ship in the wheel, and the loop builds
from an installed (not editable) copy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
CSRC = ROOT / "lightning_pure_bf16" / "ops" / "csrc"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (found,) = out.glob("lightning_pure_bf16-*.whl")
    return found


def test_the_wheel_holds_every_cpp_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))
    assert len(sources) >= 5
    missing = [s for s in sources if f"lightning_pure_bf16/ops/csrc/{s}" not in names]
    assert not missing, f"not in the wheel: {missing}"


def test_the_wheel_names_its_license_file_and_ships_it(wheel):
    archive = zipfile.ZipFile(wheel)
    (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    text = archive.read(metadata).decode()
    assert "License-File: LICENSE" in text
    (shipped,) = [n for n in archive.namelist() if n.endswith("/LICENSE") and ".dist-info/" in n]
    assert archive.read(shipped).decode() == (ROOT / "LICENSE").read_text()
    assert "Apache License" in archive.read(shipped).decode()


def test_the_loop_builds_from_an_installed_package_after_a_killed_build_and_matches_the_pytorch_path(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    script = """
import os, torch, lightning_pure_bf16
from lightning_pure_bf16 import AdamW
from lightning_pure_bf16.ops import update_cpu
assert lightning_pure_bf16.__file__.startswith(os.environ["PYTHONPATH"]), lightning_pure_bf16.__file__
assert update_cpu.fused_cpu_available(), update_cpu._failure
out = []
for backend in ("cpu", "torch"):
    p = torch.linspace(-1, 1, 1000).to(torch.bfloat16).requires_grad_()
    opt = AdamW([p], lr=1e-2, seed=3, backend=backend)
    p.grad = torch.ones_like(p)
    opt.step()
    out.append(p.detach().view(torch.int16))
assert torch.equal(*out)
print("built from", update_cpu.CSRC)
"""
    # The installed copy alone (not this checkout), with an extension cache of its own (a fresh build).
    env = {**os.environ, "PYTHONPATH": str(target), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    # A first build killed while it holds torch's build lock leaves the lock file behind (a user's Ctrl-C, a
    # preempted job); the next load must build, not wait on it forever.
    first = subprocess.Popen([sys.executable, "-c", script], env=env, cwd=tmp_path, start_new_session=True)
    deadline = time.monotonic() + 300
    while not list((tmp_path / "ext").glob("**/lock")) and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    assert first.returncode == -signal.SIGKILL and list((tmp_path / "ext").glob("**/lock")), "no build was cut off"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(target) in proc.stdout
