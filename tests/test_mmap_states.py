"""Optimizer states in memory-mapped files: same bits as in memory, files on disk only, checkpoints, bad input."""

from __future__ import annotations

import gc
import io
import os
import shutil
from pathlib import Path

import pytest
import torch

import lightning_pure_bf16.optim.mmap_states as mmap_states
from lightning_pure_bf16 import Adam, AdamW, StateStorageError
from lightning_pure_bf16.ops import rng
from lightning_pure_bf16.ops.algorithms import UpdateArgs
from lightning_pure_bf16.ops.update_cpu import fused_cpu_available, update_cpu_
from lightning_pure_bf16.ops.update_torch import update_torch_

SHAPES = [(6,), (42, 3), (3000,), (431, 7), (0,), (5000,)]
# Small chunks, so every tensor above 1024 elements streams through several chunks (and, on CUDA, both slots).
CHUNK = 1024


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.detach()


def _params(dtype=torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g).to(dtype) for s in SHAPES]


def _set_grads(params: list[torch.Tensor], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)


def _make(params, opt_cls=AdamW, **kw):
    groups = [{"params": params[:3], "weight_decay": 0.1}, {"params": params[3:], "lr": 3e-3, "betas": (0.8, 0.99)}]
    return opt_cls(groups, lr=1e-2, seed=7, **kw)


def _train(opt, params, steps, start=0):
    for t in range(start, start + steps):
        _set_grads(params, t)
        opt.step()


def _assert_same(params_a, opt_a, params_b, opt_b):
    for a, b in zip(params_a, params_b):
        assert torch.equal(_bits(a), _bits(b))
        sa, sb = opt_a.state[a], opt_b.state[b]
        assert set(sa) == set(sb)
        for key in sa:
            if isinstance(sa[key], torch.Tensor):
                assert torch.equal(_bits(sa[key]), _bits(sb[key])), key
            else:
                assert sa[key] == sb[key]


# ------------------------------------------------------------------------------------------------ index offsets
def _args(rounding: str) -> UpdateArgs:
    keys = tuple(rng.stream_key(11, 3, 5, b) for b in rng.Buffer)
    return UpdateArgs(1e-2, 0.9, 0.999, 1e-8, 0.1, True, 5, rounding, keys)  # type: ignore[arg-type]


def _buffers(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m, v, c = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01, torch.randn(n, generator=g) * 1e-4
    return [t.to(torch.bfloat16) for t in (p, grad, m, v, c)]


def _triton_update():
    pytest.importorskip("triton")
    from lightning_pure_bf16.ops.update_triton import update_triton_

    return update_triton_


def test_fused_cpu_loop_splits_pieces_at_the_2_32_index_boundary():
    if not fused_cpu_available():
        pytest.skip("the fused CPU loop did not compile")
    # Elements 2**32 - 1024 ... 2**32 + 1023 of a huge tensor: the high index word changes in the middle.
    offset = (1 << 32) - 1024
    a, b = _buffers(2048, seed=1), _buffers(2048, seed=1)
    update_cpu_(a[0], a[1], a[2:4], None, _args("stochastic"), index_offset=offset)
    update_torch_(b[0], b[1], b[2:4], None, _args("stochastic"), chunk_size=1024, index_offset=offset)
    for x, y in zip(a, b):
        assert torch.equal(_bits(x), _bits(y))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_pieces_at_any_offset_equal_the_whole_tensor(backend, rounding):
    """States in files stream a partition in chunks, and gradient release updates each parameter's slice of a flat
    partition on its own: pieces that start at chunk multiples or anywhere give the bits of the whole update."""
    if backend == "cpu" and not fused_cpu_available():
        pytest.skip("the fused CPU loop did not compile")
    update = {
        "torch": lambda *a, **k: update_torch_(*a, chunk_size=1024, **k),
        "cpu": update_cpu_,
        "triton": _triton_update() if backend == "triton" else None,
    }[backend]
    n, cuts = 5000, [0, 1, 7, 300, 1025, 1030, 2048, 3333, 4096, 4999, 5000]
    whole = _buffers(n, seed=2)
    pieces = [t.clone() for t in whole]
    update(whole[0], whole[1], whole[2:4], whole[4] if rounding == "kahan" else None, _args(rounding))
    for s, e in zip(cuts, cuts[1:]):
        chunk = [t[s:e] for t in pieces]
        update(
            chunk[0], chunk[1], chunk[2:4], chunk[4] if rounding == "kahan" else None, _args(rounding), index_offset=s
        )
    for a, b in zip(whole, pieces):
        assert torch.equal(_bits(a), _bits(b))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_piece_across_the_2_32_index_boundary_at_an_odd_offset(backend):
    """A piece whose index crosses 2**32 at an offset that is no power-of-two multiple: the torch path splits its
    chunks there and the Triton launcher its launches; both equal the fused CPU loop (or the torch path)."""
    update = (lambda *a, **k: update_torch_(*a, chunk_size=1024, **k)) if backend == "torch" else _triton_update()
    offset = (1 << 32) - 777
    a, b = _buffers(2000, seed=3), _buffers(2000, seed=3)
    update(a[0], a[1], a[2:4], None, _args("stochastic"), index_offset=offset)
    reference = update_cpu_ if fused_cpu_available() else update_torch_
    reference(b[0], b[1], b[2:4], None, _args("stochastic"), index_offset=offset)
    for x, y in zip(a, b):
        assert torch.equal(_bits(x), _bits(y))


def test_bad_index_offsets_are_refused():
    buffers = _buffers(2048)
    for update in (update_torch_, _triton_update()):
        with pytest.raises(ValueError, match="index_offset"):
            update(buffers[0], buffers[1], buffers[2:4], None, _args("stochastic"), index_offset=-1)


# --------------------------------------------------------------------------------------------- the optimizer
@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("opt_cls", [AdamW, Adam])
def test_mmap_states_give_the_in_memory_results_bit_for_bit(tmp_path, opt_cls, backend, rounding):
    init = _params()
    a, b = [p.clone().requires_grad_() for p in init], [p.clone().requires_grad_() for p in init]
    in_memory = _make(a, opt_cls, rounding=rounding, backend=backend)
    in_files = _make(
        b, opt_cls, rounding=rounding, backend=backend, state_storage="mmap", state_dir=tmp_path, state_chunk_size=CHUNK
    )
    _train(in_memory, a, 4)
    _train(in_files, b, 4)
    _assert_same(a, in_memory, b, in_files)
    in_files.close()


def test_cpu_updates_in_the_mapping_with_each_chunk_brought_in_first(tmp_path, monkeypatch):
    brought_in = []
    monkeypatch.setattr(mmap_states, "prefault", lambda t: brought_in.append((t.data_ptr(), t.numel())))
    p = torch.randn(5000).to(torch.bfloat16).requires_grad_()
    opt = AdamW([p], lr=1e-2, seed=1, state_storage="mmap", state_dir=tmp_path, state_chunk_size=CHUNK)
    calls = []
    real = mmap_states.StateStreamer.update

    def spy(self, update, param, grad, states, forward, index_base=0, defer_writes=False):  # noqa: ANN001, ANN202
        def record(param_chunk, grad_chunk, *rest, index_offset):  # noqa: ANN001, ANN202
            m = forward_args[0]
            calls.append((m.data_ptr(), m.numel(), index_offset))
            return update(param_chunk, grad_chunk, *rest, index_offset=index_offset)

        def fwd(chunks):  # noqa: ANN001, ANN202
            forward_args[:] = chunks
            return forward(chunks)

        forward_args: list = []
        return real(self, record, param, grad, states, fwd, index_base, defer_writes)

    monkeypatch.setattr(mmap_states.StateStreamer, "update", spy)
    p.grad = torch.randn(5000).to(torch.bfloat16)
    opt.step()
    m = opt.state[p]["exp_avg"]
    # Five chunks of the moment, each a piece of the file's mapping itself (no staging slot), each brought in before
    # its update; the streamer holds no buffers of its own.
    size = m.element_size()
    assert [(ptr, n) for ptr, n, _ in calls] == [
        (m.data_ptr() + i * CHUNK * size, min(CHUNK, 5000 - i * CHUNK)) for i in range(5)
    ]
    assert [off for _, _, off in calls] == [0, 1024, 2048, 3072, 4096]
    assert all(c[:2] in brought_in for c in calls)
    assert all(not b for s in opt._storage.streamers.values() for b in s.host)
    opt.close()


def _toy_update(param, grad, m, v, *, index_offset):  # noqa: ANN001, ANN202
    """A stand-in for the kernel: reads and writes every state chunk, depends on the element index."""
    m.mul_(0.5).add_(grad)
    v.mul_(0.25).add_(grad * grad)
    param.sub_(m + v * 1e-3 + index_offset * 1e-6)


def test_the_staged_pipeline_gives_the_in_place_bits_and_writes_back_after_update_returns(tmp_path):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    specs = ((torch.bfloat16, 1), (torch.bfloat16, 1))
    g = torch.Generator().manual_seed(3)
    param0, m0, v0 = (torch.randn(5000, generator=g).to(torch.bfloat16) for _ in range(3))
    grads = [torch.randn(5000, generator=g).to(torch.bfloat16) for _ in range(2)]
    results = {}
    for staged in (False, True):  # the CUDA path's pipeline (pinned slots, writer thread) run on the CPU
        streamer = mmap_states.StateStreamer(torch.device("cpu"), specs, CHUNK, staged=staged)
        param, m, v = param0.clone(), m0.clone(), v0.clone()
        # A whole tensor in five chunks, then a slice of it (as gradient release applies one) with its index base.
        streamer.update(_toy_update, param, grads[0], [m, v], tuple, 0)
        streamer.update(_toy_update, param[1536:4000], grads[1][1536:4000], [m[1536:4000], v[1536:4000]], tuple, 1536)
        streamer.wait_for_writes()
        results[staged] = (param, m, v)
        streamer.close()
    for a, b in zip(results[False], results[True]):
        assert torch.equal(a, b)

    # update returns before its last chunk is back in the file: the caller (the backward) goes on meanwhile. (Held
    # back for at most 10 s: an update that waited for its writes would return after that, written, and fail below.)
    streamer = mmap_states.StateStreamer(torch.device("cpu"), specs, CHUNK, staged=True)
    gate, writer = threading.Event(), ThreadPoolExecutor(1)
    streamer.writer.shutdown()
    held = type("Gated", (), {"submit": lambda _, fn, *a: writer.submit(lambda: (gate.wait(10), fn(*a))[1])})
    streamer.writer = held()
    param, m, v = param0[:CHUNK].clone(), m0[:CHUNK].clone(), v0[:CHUNK].clone()
    streamer.update(_toy_update, param, grads[0][:CHUNK], [m, v], tuple, 0, defer_writes=True)
    assert torch.equal(m, m0[:CHUNK]) and not torch.equal(param, param0[:CHUNK])  # computed, not yet written back
    gate.set()
    streamer.wait_for_writes()
    expected = [t[:CHUNK].clone() for t in (param0, m0, v0)]
    _toy_update(expected[0], grads[0][:CHUNK], expected[1], expected[2], index_offset=0)
    assert torch.equal(m, expected[1]) and torch.equal(v, expected[2]) and torch.equal(param, expected[0])
    writer.shutdown()
    streamer.writer = None
    streamer.close()


def test_a_state_file_that_cannot_be_read_in_is_an_error_not_a_crash(tmp_path):
    path = tmp_path / "states.bin"
    path.write_bytes(bytes(1 << 20))
    mapped = torch.from_file(str(path), shared=True, size=1 << 20, dtype=torch.uint8)
    mmap_states.prefault(mapped)
    os.truncate(path, 4096)  # behind the optimizer's back, after its per-step check
    with pytest.raises(StateStorageError, match="could not be read into memory.*resume from the last checkpoint"):
        mmap_states.prefault(mapped[8192:])


def test_kernels_without_populate_write_fall_back_to_readahead(tmp_path, monkeypatch):
    advised = []

    def old_kernel(t, advice):  # noqa: ANN001, ANN202
        advised.append(advice)
        return 22 if advice == mmap_states._MADV_POPULATE_WRITE else 0  # EINVAL: unknown advice

    monkeypatch.setattr(mmap_states, "_madvise", old_kernel)
    monkeypatch.setattr(mmap_states, "_populate_write", True)
    init = _params()
    a, b = [p.clone().requires_grad_() for p in init], [p.clone().requires_grad_() for p in init]
    in_memory = _make(a)
    in_files = _make(b, state_storage="mmap", state_dir=tmp_path, state_chunk_size=CHUNK)
    _train(in_memory, a, 2)
    _train(in_files, b, 2)
    _assert_same(a, in_memory, b, in_files)
    assert advised[0] == mmap_states._MADV_POPULATE_WRITE and not mmap_states._populate_write
    assert set(advised[1:]) == {mmap_states._MADV_WILLNEED}
    in_files.close()


def test_mmap_states_with_the_triton_kernel(tmp_path):
    _triton_update()
    init = _params()[:3]
    a, b = [p.clone().requires_grad_() for p in init], [p.clone().requires_grad_() for p in init]
    in_memory = AdamW(a, lr=1e-2, seed=3, backend="triton")
    in_files = AdamW(
        b, lr=1e-2, seed=3, backend="triton", state_storage="mmap", state_dir=tmp_path, state_chunk_size=CHUNK
    )
    _train(in_memory, a, 2)
    _train(in_files, b, 2)
    _assert_same(a, in_memory, b, in_files)


def test_float32_and_non_contiguous_parameters(tmp_path):
    base = torch.randn(64, 40)
    a = [torch.randn(3000).requires_grad_(), base.clone().to(torch.bfloat16).t().requires_grad_()]
    b = [t.detach().clone().requires_grad_() for t in a]
    b[1] = base.clone().to(torch.bfloat16).t().requires_grad_()
    assert not b[1].is_contiguous()
    in_memory = AdamW(a, lr=1e-2, seed=1)
    in_files = AdamW(b, lr=1e-2, seed=1, state_storage="mmap", state_dir=tmp_path, state_chunk_size=CHUNK)
    _train(in_memory, a, 3)
    _train(in_files, b, 3)
    _assert_same(a, in_memory, b, in_files)


def test_states_live_in_one_file_per_tensor_and_nowhere_else(tmp_path):
    params = [p.requires_grad_() for p in _params()]
    opt = _make(params, rounding="kahan", state_storage="mmap", state_dir=tmp_path, state_chunk_size=CHUNK)
    _train(opt, params, 1)
    directory = Path(opt.state_dir)
    assert directory.parent == tmp_path and directory.name.startswith("pure_bf16_states-")
    files = sorted(directory.iterdir())
    assert len(files) == len(params)
    for p in params:
        state = opt.state[p]
        if p.numel() == 0:
            continue  # an empty file maps to nothing
        names = {state[k].untyped_storage().filename for k in ("exp_avg", "exp_avg_sq", "kahan_comp")}
        assert len(names) == 1
        (name,) = names
        assert Path(name).parent == directory
        assert os.path.getsize(name) == 3 * 2 * p.numel()
        assert all(state[k].dtype == torch.bfloat16 and state[k].shape == p.shape for k in ("exp_avg", "exp_avg_sq"))
    opt.close()


def test_close_removes_the_files_and_stops_the_optimizer(tmp_path):
    params = [p.requires_grad_() for p in _params()]
    opt = _make(params, state_storage="mmap", state_dir=tmp_path)
    _train(opt, params, 1)
    assert any(tmp_path.iterdir())
    opt.close()
    opt.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        opt.step()
    with pytest.raises(RuntimeError, match="no moments to save"):
        opt.state_dict()


def _close_in_child(opt) -> None:
    opt.close()


def test_a_forked_child_never_removes_the_parents_files(tmp_path):
    import multiprocessing

    params = [p.requires_grad_() for p in _params()]
    opt = _make(params, state_storage="mmap", state_dir=tmp_path)
    _train(opt, params, 1)
    files = sorted(Path(opt.state_dir).iterdir())
    child = multiprocessing.get_context("fork").Process(target=_close_in_child, args=(opt,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert sorted(Path(opt.state_dir).iterdir()) == files
    _train(opt, params, 1, start=1)
    opt.close()


def test_garbage_collection_removes_the_files(tmp_path):
    params = [p.requires_grad_() for p in _params()]
    opt = _make(params, state_storage="mmap", state_dir=tmp_path)
    _train(opt, params, 1)
    del opt
    gc.collect()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("saved_in", "loaded_in"), [("mmap", "mmap"), ("memory", "mmap"), ("mmap", "memory")])
def test_state_dict_resume_continues_bit_for_bit(tmp_path, saved_in, loaded_in):
    def make(params, storage, sub):
        kw = (
            {"state_storage": "mmap", "state_dir": tmp_path / sub, "state_chunk_size": CHUNK}
            if storage == "mmap"
            else {}
        )
        (tmp_path / sub).mkdir(exist_ok=True)
        return _make(params, rounding="kahan", **kw)

    init = _params()
    ref = [p.clone().requires_grad_() for p in init]
    ref_opt = make(ref, "memory", "ref")
    _train(ref_opt, ref, 6)

    first = [p.clone().requires_grad_() for p in init]
    opt = make(first, saved_in, "first")
    _train(opt, first, 3)
    saved = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)

    second = [p.detach().clone().requires_grad_() for p in first]
    resumed = make(second, loaded_in, "second")
    resumed.load_state_dict(torch.load(buffer, weights_only=False))
    _train(resumed, second, 3, start=3)
    _assert_same(ref, ref_opt, second, resumed)


def test_loading_states_of_another_model_changes_nothing(tmp_path):
    params = [p.requires_grad_() for p in _params()]
    opt = _make(params, state_storage="mmap", state_dir=tmp_path)
    _train(opt, params, 1)
    saved = opt.state_dict()
    saved["state"][2]["exp_avg"] = torch.zeros(7, dtype=torch.bfloat16)
    before = opt.state[params[2]]["exp_avg"].clone()
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict(saved)
    assert torch.equal(opt.state[params[2]]["exp_avg"], before)


# ----------------------------------------------------------------------------------------------- bad input
def test_options_are_checked(tmp_path):
    p = [torch.zeros(3, dtype=torch.bfloat16, requires_grad=True)]
    with pytest.raises(ValueError, match="needs `state_dir`"):
        AdamW(p, state_storage="mmap")
    with pytest.raises(ValueError, match="only used with `state_storage='mmap'`"):
        AdamW(p, state_dir=tmp_path)
    with pytest.raises(ValueError, match="state_storage='disk'"):
        AdamW(p, state_storage="disk", state_dir=tmp_path)
    with pytest.raises(ValueError, match="power of two"):
        AdamW(p, state_storage="mmap", state_dir=tmp_path, state_chunk_size=3000)


def test_missing_state_dir(tmp_path):
    with pytest.raises(StateStorageError, match="does not exist"):
        AdamW([torch.zeros(3, requires_grad=True)], state_storage="mmap", state_dir=tmp_path / "nope")


def test_state_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(StateStorageError, match="not a directory"):
        AdamW([torch.zeros(3, requires_grad=True)], state_storage="mmap", state_dir=tmp_path / "f")


def test_read_only_state_dir():
    # /proc refuses new files to every user, root included (a chmod'ed directory does not stop root).
    with pytest.raises(StateStorageError, match="cannot create files"):
        AdamW([torch.zeros(3, requires_grad=True)], state_storage="mmap", state_dir="/proc")


def test_full_disk_is_an_error_before_anything_changes(tmp_path, monkeypatch):
    params = [p.requires_grad_() for p in _params()]
    before = [p.detach().clone() for p in params]
    opt = _make(params, state_storage="mmap", state_dir=tmp_path)
    monkeypatch.setattr(mmap_states.shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**6, 10**6 - 1000, 1000))
    _set_grads(params, 0)
    with pytest.raises(StateStorageError, match="has 1000 bytes free"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert all(len(opt.state[p]) == 0 or "exp_avg" not in opt.state[p] for p in params)
    assert not any(Path(tmp_path).rglob("*.bin"))


def test_failed_reservation_removes_the_files_of_the_step(tmp_path, monkeypatch):
    params = [p.requires_grad_() for p in _params()]
    before = [p.detach().clone() for p in params]
    opt = _make(params, state_storage="mmap", state_dir=tmp_path)
    calls = []

    def fallocate(fd, offset, length):
        calls.append(length)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        os.ftruncate(fd, length)

    monkeypatch.setattr(mmap_states.os, "posix_fallocate", fallocate)
    _set_grads(params, 0)
    with pytest.raises(StateStorageError, match="the disk is full"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert not any(Path(tmp_path).rglob("*.bin"))


@pytest.mark.parametrize("tamper", ["truncate", "remove", "replace"])
def test_a_tampered_state_file_stops_the_step(tmp_path, tamper):
    params = [p.requires_grad_() for p in _params()]
    opt = _make(params, state_storage="mmap", state_dir=tmp_path)
    _train(opt, params, 1)
    path = Path(opt.state[params[3]]["exp_avg"].untyped_storage().filename)
    if tamper == "truncate":
        os.truncate(path, 10)
    elif tamper == "remove":
        path.unlink()
    else:
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
    before = [p.detach().clone() for p in params]
    _set_grads(params, 1)
    with pytest.raises(StateStorageError, match="cannot be trusted"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    opt.close()


def test_filesystem_type_reads_the_mount_table():
    assert mmap_states.filesystem_type("/proc/self") == "proc"


def test_a_killed_runs_state_directory_is_named_by_the_next_run(tmp_path):
    import subprocess
    import sys

    from lightning_pure_bf16.optim.mmap_states import left_behind

    # A run killed mid-way (SIGKILL: nothing closes its files) leaves its directory behind.
    code = (
        "import os, signal, torch\nfrom lightning_pure_bf16 import AdamW\n"
        "p = torch.zeros(4096, dtype=torch.bfloat16)\n"
        f"opt = AdamW([p], state_storage='mmap', state_dir={str(tmp_path)!r})\n"
        "opt.init_states([(p, opt.param_groups[0])])\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == -9
    (stale,) = left_behind(tmp_path)
    q = torch.zeros(16, dtype=torch.bfloat16)
    with pytest.warns(
        UserWarning, match=r"1 state directory of a run that ended without closing .* hold 16384 bytes"
    ) as seen:
        live = AdamW([q], state_storage="mmap", state_dir=tmp_path)
        live.init_states([(q, live.param_groups[0])])
    assert str(stale) in str(seen[0].message)
    assert left_behind(tmp_path) == [stale]  # this run's own directory is not named: its process is running
    live.close()
