"""Every private DeepSpeed, Lightning and torch name the package relies on, checked against the installed versions.

The names and the copied upstream code are listed once, in ``tests/upstream_names.py`` (the access itself is all in
``lightning_pure_bf16/_internals/``); these tests check each entry. An upgrade that renames or removes one of them,
or changes code the package copies, fails here naming it, instead of silently turning a feature off (a memory report
of 0 bytes, a skipped step never logged, a warning filter that no longer matches).
"""

import ast
import inspect
import pathlib
import re

import pytest
import torch

from lightning_pure_bf16 import _internals, collectives, safe_load
from lightning_pure_bf16._internals import UpstreamChanged, resolve
from tests.upstream_names import COPIED_UPSTREAM, OPTIONAL_OWNERS, PRIVATE_NAMES, source_fingerprint, undecorated

PACKAGE = pathlib.Path(_internals.__file__).parent.parent


def _internal(path: pathlib.Path) -> bool:
    """Whether ``path`` is a file of the private surface (the ``_internals`` package)."""
    return "_internals" in path.parts or path.name == "_internals.py"


@pytest.mark.parametrize("entry", PRIVATE_NAMES, ids=lambda e: f"{e.owner.split(':')[-1]}.{e.name}"[:60])
def test_private_name_exists(entry):
    if entry.owner.split(".")[0] in OPTIONAL_OWNERS:
        pytest.importorskip(entry.owner.split(".")[0])
    owner = resolve(entry.owner)
    where = f"{entry.owner} `{entry.name}` ({entry.why})"
    if entry.kind == "attribute":
        source = inspect.getsource(owner)
        pattern = rf"self\.{re.escape(entry.name)}\s*(:[^=\n]+)?=[^=]"
        assert re.search(pattern, source) or entry.name in vars(owner), f"no longer assigned: {where}"
    elif entry.kind in ("method", "function"):
        assert hasattr(owner, entry.name), f"gone: {where}"
        # Under a decorator that keeps the function only in its closure (DeepSpeed's instrument_w_nvtx).
        params = list(inspect.signature(undecorated(getattr(owner, entry.name), entry.name)).parameters)
        assert params[: len(entry.params)] == list(entry.params), f"signature changed to {params}: {where}"
    else:
        assert entry.kind == "marker", entry.kind
        assert entry.name in inspect.getsource(owner), f"not in the source any more: {where}"


@pytest.mark.parametrize("target", sorted(COPIED_UPSTREAM))
def test_copied_upstream_code_is_unchanged(target):
    if target.split(".")[0] in OPTIONAL_OWNERS:
        pytest.importorskip(target.split(".")[0])
    entry = COPIED_UPSTREAM[target]
    fingerprint = source_fingerprint(target)
    assert fingerprint in entry["tested"].values(), (
        f"{target} changed upstream (fingerprint {fingerprint}, tested: {entry['tested']}). Review {entry['ours']}"
        " against the new code, then add the fingerprint to tests/upstream_names.py's COPIED_UPSTREAM."
    )


def test_fingerprint_sees_code_and_ignores_formatting(tmp_path, monkeypatch):
    module = tmp_path / "fp_probe.py"
    monkeypatch.syspath_prepend(str(tmp_path))
    variants = {
        "a": 'def f(x: int) -> int:\n    """doc"""\n    # note\n    return x + 1\n',
        "b": "def f(x):\n    return (x +\n            1)\n",
        "c": "def f(x):\n    return x + 2\n",
    }
    seen = {}
    for key, text in variants.items():
        module.write_text(text)
        import importlib
        import sys

        sys.modules.pop("fp_probe", None)
        importlib.invalidate_caches()
        seen[key] = source_fingerprint("fp_probe:f")
    assert seen["a"] == seen["b"] != seen["c"]


def test_no_other_module_touches_the_private_surface():
    # The names of PRIVATE_NAMES that are attributes of another library's objects appear nowhere else in the package.
    attributes = {e.name for e in PRIVATE_NAMES if e.kind in ("attribute", "method") and e.name.startswith("_")}
    attributes |= {
        "fp16_partitioned_groups_flat",
        "fp32_partitioned_groups_flat",
        "grad_partitions_flat_buffer",
        "sub_group_to_group_id",
        "skipped_steps",
    }
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if _internal(path):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            # What a class reads of what it inherits is test_every_private_upstream_access_is_in_internals_and_listed's.
            if isinstance(node, ast.Attribute) and node.attr in attributes and not _is_self(node.value):
                base = ast.unparse(node.value)
                # The optimizer's own counter of skipped steps is ours, not DeepSpeed's engine's.
                if node.attr == "skipped_steps" and base in ("self", "base", "optimizer", "opt", "new", "converted"):
                    continue
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {ast.unparse(node)}")
    assert not offenders, f"private names read outside _internals.py: {offenders}"


def test_a_renamed_attribute_raises_naming_it():
    class RenamedZero3:
        fp16_partitioned_groups_flat = []

    with pytest.raises(UpstreamChanged, match="grad_partitions_flat_buffer.*pyproject"):
        _internals.zero3_grad_partition_buffer(RenamedZero3())
    with pytest.raises(UpstreamChanged, match="overflow"):
        _internals.zero3_step_skipped(object())


def test_deepspeed_accelerator_can_be_set():
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    assert CPU_Accelerator().device_name() == "cpu" and CUDA_Accelerator().device_name() == "cuda"


def test_warning_filters_match_their_origins(monkeypatch):
    import importlib
    import logging
    import re
    import warnings

    from lightning_pure_bf16 import _warnings
    from lightning_pure_bf16._warnings import KNOWN_LOG_RECORDS, KNOWN_WARNINGS, silence_known_warnings

    monkeypatch.setattr(_warnings, "_installed", False)  # pytest restores the filters after each test
    silence_known_warnings()
    installed = {
        (f[1].pattern, f[2], f[3].pattern) for f in warnings.filters if f[0] == "ignore" and f[1] and f[3] is not None
    }
    for message, category, module in KNOWN_WARNINGS:
        # warnings.filterwarnings matches `module` against the warning's module name: each names a module that exists
        # under that exact name, and each is installed as an "ignore" filter of its message and category.
        imported = importlib.import_module(module.replace("\\.", "."))
        assert re.fullmatch(module, imported.__name__), module
        assert (message, category, module) in installed, message
    import deepspeed  # noqa: F401  (its logger exists once it is imported)

    for name, start in KNOWN_LOG_RECORDS:
        assert name in logging.Logger.manager.loggerDict and start, name


def test_master_aliasing_bug_and_fix():
    """DeepSpeed compares a torch.device with a string and copies every master partition; the fix aliases them."""
    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    class Probe:
        offload_optimizer = False

    seen = {}

    def original(self):
        partition = torch.zeros(4, dtype=torch.bfloat16)
        seen["aliased"] = partition.device == self.device

    saved = DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions
    DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = original
    try:
        probe = Probe()
        probe.device = "cpu"  # what DeepSpeed stores
        original(probe)
        assert seen["aliased"] is False  # the bug: the device never equals the string
        with _internals.alias_bf16_master_partitions():
            DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions(probe)
        assert seen["aliased"] is True and probe.device == "cpu"  # the fix, and the attribute restored
    finally:
        DeepSpeedZeroOptimizer_Stage3._create_fp32_partitions = saved
    # The comparison the fix is about is still there in the installed DeepSpeed.
    assert re.search(r"fp16_partitioned_groups_flat\[i\]\.device == self\.device", inspect.getsource(saved))


UPSTREAM = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "deepspeed", "triton", "torchdata")


def _private_upstream_imports(path: pathlib.Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in UPSTREAM:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.split(".")[0] in UPSTREAM]
        else:
            continue
        found += [f"{path.name}:{node.lineno} {n}" for n in names if any(p.startswith("_") for p in n.split("."))]
    return found


def test_only_the_upstream_module_imports_private_upstream_names(tmp_path):
    offenders = [
        hit for path in sorted(PACKAGE.rglob("*.py")) if not _internal(path) for hit in _private_upstream_imports(path)
    ]
    assert not offenders, f"private upstream names imported outside _internals.py: {offenders}"
    # The check sees one when there is one.
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from lightning.fabric.utilities.data import _update_dataloader\n")
    assert _private_upstream_imports(probe) == ["probe.py:2 lightning.fabric.utilities.data._update_dataloader"]


@pytest.mark.parametrize(("clip", "norm"), [(0.0, 8.0), (1.0, 0.5), (1.0, 4.0)], ids=["off", "within", "clipped"])
def test_zero3_hands_its_gradient_factor_to_the_update_instead_of_scaling_the_gradient(clip, norm):
    # ZeRO-3's own method on a stand-in holding what it reads multiplies the bf16 gradient in place; wrapped, the
    # gradient is left as it is (its version counter does not move) and the sub-group's update passes the factor to
    # the optimizer's step, with the master partition in its param group: the same float32 value, since its product
    # with the widened gradient, rounded to bf16, is ZeRO-3's gradient bit for bit.
    import types

    import torch
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    class Recorder:
        def __init__(self):
            self.param_groups, self.steps = [{"params": []}, {"params": []}], []

        def step(self, **kwargs):
            self.steps.append((kwargs, list(self.param_groups[1]["params"])))

    grad = torch.randn(4096, generator=torch.Generator().manual_seed(0)).bfloat16()
    master = torch.zeros(4096, dtype=torch.bfloat16)
    zero = types.SimpleNamespace(
        loss_scale=1.0,
        clip_grad=clip,
        fp32_partitioned_groups_flat=[master],
        sub_group_to_group_id={0: 1},
        optimizer=Recorder(),
    )
    zero.unscale_and_clip_grads = types.MethodType(DeepSpeedZeroOptimizer_Stage3.unscale_and_clip_grads, zero)
    zero._optimizer_step = types.MethodType(DeepSpeedZeroOptimizer_Stage3._optimizer_step, zero)
    master.grad = deepspeeds = grad.clone()
    zero.unscale_and_clip_grads(0, torch.tensor(norm))
    master.grad, version = grad, grad._version
    _internals.fold_gradient_scale(zero)
    zero.unscale_and_clip_grads(0, torch.tensor(norm))
    zero._optimizer_step(0)
    assert grad._version == version and len(zero.optimizer.steps) == 1
    (kwargs, stepped), factor = zero.optimizer.steps[0], zero.optimizer.steps[0][0]["grad_scale"]
    assert set(kwargs) == {"grad_scale"} and len(stepped) == 1 and stepped[0] is master
    assert zero.optimizer.param_groups[1]["params"] == []
    assert factor == (1.0 if norm <= clip or not clip else pytest.approx(clip / (norm + 1e-6), rel=1e-6))
    assert torch.equal((grad.float() * torch.tensor(factor)).bfloat16(), deepspeeds)


def test_the_gradient_norm_reads_each_gradient_once_and_gives_deepspeeds_norm(monkeypatch):
    # ZeRO-3 casts each gradient partition to float64 before its norm: a copy of the gradient. Wrapped, its function
    # sees each gradient as one float64 element (its norm), attributed to its own parameter, and the norm is the same.
    import torch

    monkeypatch.setattr(collectives, "NORM_ROW", 100)
    calls = []

    class ZeroOptimizer:
        def get_grad_norm_direct(self, gradients, params, norm_type=2):
            calls.append((gradients, params))
            norms = torch.stack([g.to(torch.float64).norm(norm_type) for g in gradients])
            return norms.pow(norm_type).sum().pow(1 / norm_type)

    grads = [torch.randn(250, dtype=torch.bfloat16), torch.randn(7, 3, dtype=torch.bfloat16)]
    params = ["big", "small"]
    zero = ZeroOptimizer()
    expected = zero.get_grad_norm_direct(grads, params)
    collectives.gradient_norm_in_one_pass(zero)
    got = zero.get_grad_norm_direct(grads, params)
    seen, owners = calls[-1]
    assert [(t.dtype, t.numel()) for t in seen] == [(torch.float64, 1)] * 2 and owners == params
    assert torch.allclose(got, expected, rtol=1e-6, atol=0)
    zero.get_grad_norm_direct(grads, params, float("inf"))
    assert calls[-1][0] is grads  # another norm: DeepSpeed's own path
    grads[1][2, 1] = float("nan")
    assert zero.get_grad_norm_direct(grads, params).isnan()
    # Squares past float32's range count as non-finite, as under torch's clip_grad_norm_.
    assert collectives.gradient_norm(torch.full((4,), 1e20, dtype=torch.bfloat16)).isinf()


def test_the_norm_for_fabric_clipping_reads_the_partition_once_in_bounded_pieces(monkeypatch):
    import torch

    monkeypatch.setattr(collectives, "NORM_PIECE", 256)
    monkeypatch.setattr(collectives, "NORM_ROW", 64)
    buffer = torch.randn(1000, dtype=torch.bfloat16)
    seen = []
    real_norm = torch.linalg.vector_norm

    def recorded(x, *args, **kwargs):
        seen.append((x.numel(), x.dtype, kwargs.get("dtype")))
        return real_norm(x, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", recorded)

    class ZeroOptimizer:
        grad_partitions_flat_buffer = buffer

    norm = collectives.zero3_grad_norm(ZeroOptimizer())
    # The partition read once, in pieces of at most 256 elements (rows of 64 and a rest), reduced in float32; then the
    # 16 rows' norms combined in float64.
    reads = [(n, dtype) for n, source, dtype in seen if source == torch.bfloat16]
    assert reads == [(256, torch.float32)] * 3 + [(192, torch.float32), (40, torch.float32)]
    assert seen[-1] == (16, torch.float32, torch.float64)
    assert torch.allclose(norm, buffer.double().norm().float(), rtol=1e-6)


def test_fingerprint_sees_through_a_decorator_that_hides_the_function():
    # DeepSpeed's instrument_w_nvtx keeps the method only in its closure (no functools.wraps): fingerprinting the
    # decorator's source would give every decorated method the same fingerprint, and miss any change upstream.
    stage3 = "deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3"
    names = ("step", "partition_grads", "_prepare_fp32_grad_for_sub_group")
    assert len({source_fingerprint(f"{stage3}.{name}") for name in names}) == len(names)


@pytest.mark.parametrize("name", safe_load.DCP_METADATA_GLOBALS)
def test_every_class_a_dcp_metadata_file_may_name_exists(name):
    module, _, qualname = name.partition(":")
    assert safe_load.dcp_metadata_global(module, qualname) is resolve(name)
    # Anything else is refused, torch's callables included.
    assert safe_load.dcp_metadata_global("torch", "load") is None
    assert safe_load.dcp_metadata_global("os", "system") is None


def _gloo_collectives(rank, world, store, out):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    collectives.COLLECTIVE_PIECE = 10 * world  # 10 elements per rank; the tensors below span several pieces
    collectives.SUM_PIECE = 4  # the float32 sums of more than 2 ranks in several pieces, the last partial
    sizes = {"gather": [], "exchange": []}

    def spy(key, fn):
        def call(*args, **kwargs):
            sizes[key].append(max(t.numel() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)))
            return fn(*args, **kwargs)

        return call

    gather = collectives.all_gather_in_pieces(spy("gather", dist.all_gather_into_tensor))
    scatter = collectives.reduce_scatter_by_exchange(dist.reduce_scatter_tensor)
    dist.all_to_all_single = spy("exchange", dist.all_to_all_single)
    inputs = [torch.randn(world * 37, generator=torch.Generator().manual_seed(r)).bfloat16() for r in range(world)]
    part, full = inputs[rank][:37], inputs[rank]
    # Every rank's sum in float32 in rank order, rounded once to bf16 (each rank knows every rank's input).
    total = torch.stack(inputs).float().sum(0).bfloat16()
    expected_scatter = total.view(world, 37)[rank]
    gloo_scatter, expected_gather = torch.empty(37, dtype=torch.bfloat16), torch.empty(world * 37, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(expected_gather, part)
    dist.reduce_scatter_tensor(gloo_scatter, full.clone())
    gathered, scattered = torch.empty(world * 37, dtype=torch.bfloat16), torch.empty(37, dtype=torch.bfloat16)
    gather(output_tensor=gathered, input_tensor=part, group=None, async_op=True).wait()
    scatter(scattered, full.clone(), op=dist.ReduceOp.SUM, group=None, async_op=True).wait()
    in_pieces = {k: list(v) for k, v in sizes.items()}
    whole = torch.empty(8, dtype=torch.bfloat16)
    scatter(whole, full[: world * 8].clone(), op=None, group=None)  # at most two pieces: one exchange, whole
    expected_whole = torch.stack(inputs)[:, : world * 8].float().sum(0).bfloat16()[rank * 8 : rank * 8 + 8]
    gather(output_tensor=torch.empty(world * 4, dtype=torch.bfloat16), input_tensor=part[:4], group=None)
    torch.save(
        {
            "gather_equal": torch.equal(gathered, expected_gather),
            "scatter_equal": torch.equal(scattered, expected_scatter),
            "gloo_equal": torch.equal(scattered, gloo_scatter),
            "whole_equal": torch.equal(whole, expected_whole),
            "in_pieces": in_pieces,
            "whole": {k: v[len(in_pieces[k]) :] for k, v in sizes.items()},
        },
        out / f"rank{rank}.pt",
    )
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_collectives_in_pieces_give_the_whole_result(tmp_path, world):
    """gloo stages a whole all-gather/reduce-scatter in temporaries as large as the layer; in pieces, every call to it
    holds at most one piece per rank. The all-gather gives the same bits; the reduce-scatter, an all-to-all and a
    local sum, gives each rank the sum of the ranks' rows in float32 rounded once: on 2 ranks gloo's own bits."""
    import torch
    import torch.multiprocessing as mp

    mp.start_processes(_gloo_collectives, args=(world, tmp_path / "store", tmp_path), nprocs=world, start_method="fork")
    for rank in range(world):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        assert result["gather_equal"] and result["scatter_equal"] and result["whole_equal"]
        assert result["gloo_equal"] or world > 2
        # 37 elements per rank in pieces of 10 per rank: 4 calls each, none larger than the ranks x 10.
        in_pieces = [world * 10] * 3 + [world * 7]
        assert result["in_pieces"] == {"gather": in_pieces, "exchange": in_pieces}
        assert result["whole"] == {"gather": [world * 4], "exchange": [world * 8]}


def test_gloo_collectives_installed_once_on_deepspeeds_backend(monkeypatch):
    import deepspeed.comm.comm as ds_comm

    class Backend:
        all_gather_function = staticmethod(lambda **kwargs: None)
        reduce_scatter_function = staticmethod(lambda *args, **kwargs: None)

    backend = Backend()
    monkeypatch.setattr(ds_comm, "cdb", backend)
    collectives.bounded_gloo_collectives()
    first = (backend.all_gather_function, backend.reduce_scatter_function)
    collectives.bounded_gloo_collectives()
    assert first == (backend.all_gather_function, backend.reduce_scatter_function)
    assert all(getattr(f, "_pure_bf16_wrapped", False) for f in first)


def test_a_resume_reads_deepspeeds_files_through_the_given_reader_and_puts_its_own_back(tmp_path):
    # engine_checkpoints.load_checkpoint reads a same-layout checkpoint through DeepSpeed's engine, every file
    # memory-mapped and weights-only (safe_load.load_state_file): the engine's reader is replaced for the load, and
    # only for it.
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from lightning_pure_bf16._internals import deepspeed_checkpoint_reads
    from lightning_pure_bf16.safe_load import load_state_file

    torch.save({"w": torch.arange(4.0)}, tmp_path / "f.pt")

    class Engine:
        checkpoint_engine = TorchCheckpointEngine()

    engine, read = Engine(), []
    own = engine.checkpoint_engine.load
    with deepspeed_checkpoint_reads(engine, lambda path: read.append(path) or load_state_file(path)):
        loaded = engine.checkpoint_engine.load(str(tmp_path / "f.pt"), map_location="cpu")
    assert read == [str(tmp_path / "f.pt")] and torch.equal(loaded["w"], torch.arange(4.0))
    assert engine.checkpoint_engine.load == own


# ------------------------------------------------------------------------------------- the guard, over all the source
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _listed(name: str) -> bool:
    """In PRIVATE_NAMES, a name-mangled ``_Class__name`` as its ``__name``."""
    names = {entry.name for entry in PRIVATE_NAMES if entry.kind != "marker"}
    names |= {word for entry in PRIVATE_NAMES if entry.kind == "marker" for word in re.findall(r"\w+", entry.name)}
    return name in names or re.sub(r"^_[A-Za-z0-9]+(__\w+)$", r"\1", name) in names


def _is_self(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: a class reading what it inherits."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _inherited(trees: dict[pathlib.Path, ast.Module]) -> dict[str, str]:
    """Each private name a class of the package uses on ``self`` (or defines) that one of its upstream bases has: the
    name, to the base."""
    import importlib

    found = {}
    for path, tree in trees.items():
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            used = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            used |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and _is_self(n.value)}
            used = {name for name in used if _private(name)}
            cls = getattr(importlib.import_module(module), node.name, None) if used else None
            if not isinstance(cls, type):
                continue
            bases = [b for b in cls.__mro__[1:] if b.__module__.split(".")[0] != PACKAGE.name and b is not object]
            for name in used:
                for base in bases:
                    try:
                        source = inspect.getsource(base)
                    except (OSError, TypeError):
                        source = ""
                    if name in vars(base) or f"self.{name}" in source:
                        found[name] = f"{base.__module__}:{base.__qualname__}"
                        break
    return found


def private_accesses(trees: dict[pathlib.Path, ast.Module], inherited: dict[str, str]) -> list[str]:
    """What the guard refuses: outside ``_internals.py``, a private attribute the package does not define, read or set
    on anything but ``self`` (where inherited private names must be listed); in ``_internals.py``, such an attribute,
    or a name read with ``_read``/``getattr``, that PRIVATE_NAMES does not list; anywhere, an inherited one unlisted."""
    own = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _is_self(node.value):
                own.add(node.attr)
            elif isinstance(node, ast.Attribute) and node.attr.startswith("_pure_bf16"):
                own.add(node.attr)  # the package's own marks on other objects
    own -= set(inherited)
    offenders = []
    for path, tree in trees.items():
        internal = _internal(path)
        for node in ast.walk(tree):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in own:
                if internal or _is_self(node.value):
                    if not _listed(node.attr):
                        offenders.append(f"{where} {ast.unparse(node)} (not in PRIVATE_NAMES)")
                else:
                    offenders.append(f"{where} {ast.unparse(node)} (outside _internals.py)")
            elif (
                internal
                and isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("_read", "getattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and (node.func.id == "_read" or _private(node.args[1].value))
                and node.args[1].value not in own
                and not _listed(node.args[1].value)
            ):
                offenders.append(f"{where} {node.func.id}(..., {node.args[1].value!r}) (not in PRIVATE_NAMES)")
    offenders += [
        f"inherited {name} of {base} (not in PRIVATE_NAMES)" for name, base in inherited.items() if not _listed(name)
    ]
    return offenders


def test_every_private_upstream_access_is_in_internals_and_listed(tmp_path):
    trees = {path: ast.parse(path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))}
    inherited = _inherited(trees)
    assert "_setup_distributed" in inherited and "_init_deepspeed_distributed" in inherited  # the walk sees them
    offenders = private_accesses(trees, inherited)
    assert not offenders, f"private upstream names outside _internals.py or missing from PRIVATE_NAMES: {offenders}"
    # Planted: a module reading a private attribute of another library's object, and _internals reading an unlisted one.
    planted = {
        tmp_path / "planted.py": ast.parse("def f(engine):\n    return engine._hidden_state\n"),
        tmp_path / "_internals.py": ast.parse("def g(zero):\n    return _read(zero, '_unlisted', 'why')\n"),
    }
    assert private_accesses({**trees, **planted}, inherited) == [
        "planted.py:2 engine._hidden_state (outside _internals.py)",
        "_internals.py:2 _read(..., '_unlisted') (not in PRIVATE_NAMES)",
    ]
