"""Adafactor and Muon, the algorithms whose update needs whole parameters: torch.optim's arithmetic, the rounded
writes, tensors that hold runs of several parameters (ZeRO-3's flat partitions) on one rank and on two, state dicts,
the inf/NaN skip and the refused options."""

import copy
import io

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pure_bf16 import Adafactor, Muon
from lightning_pure_bf16.optim import pieces as pieces_mod
from tests.reference.bf16 import TOLERANCES

# Per algorithm: ours, torch's, the shapes it steps, two param groups' options.
ALGORITHMS = {
    "adafactor": (
        Adafactor,
        torch.optim.Adafactor,
        [(6, 5), (3, 4, 7), (9,), (), (33, 2)],
        [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "beta2_decay": -0.6, "d": 0.5}],
    ),
    "muon": (
        Muon,
        torch.optim.Muon,
        [(6, 5), (4, 9), (16, 16), (40, 3)],
        [{"lr": 1e-2, "weight_decay": 0.1}, {"lr": 3e-3, "nesterov": False, "adjust_lr_fn": "match_rms_adamw"}],
    ),
}


def _init(shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _grad(shape, step, index):
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + index))


def _run(cls, init, groups, steps, start=0, opt=None, **kw):
    params = [p.clone().requires_grad_() for p in init] if opt is None else init
    if opt is None:
        half = len(params) // 2
        opt = cls([{"params": params[:half], **groups[0]}, {"params": params[half:], **groups[1]}], **kw)
    for t in range(start, start + steps):
        for i, p in enumerate(params):
            p.grad = _grad(p.shape, t, i).to(p.dtype)
        opt.step()
    return params, opt


@pytest.mark.parametrize("steps", [1, 10])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_float32_arithmetic_equals_torch(name, steps):
    """On float32 parameters each algorithm computes what torch.optim's does (weights and states), with two groups."""
    ours, theirs, shapes, groups = ALGORITHMS[name]
    init = _init(shapes)
    mine, opt = _run(ours, init, groups, steps)
    ref, ref_opt = _run(theirs, init, groups, steps)
    for p, q in zip(mine, ref):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=2e-6)
    if name == "adafactor":
        stats = opt.state[mine[0]]["statistics"]
        torch.testing.assert_close(stats["row_var"], ref_opt.state[ref[0]]["row_var"].reshape(-1))
        torch.testing.assert_close(stats["col_var"], ref_opt.state[ref[0]]["col_var"].reshape(-1))
    else:
        torch.testing.assert_close(opt.state[mine[0]]["exp_avg"], ref_opt.state[ref[0]]["momentum_buffer"])


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_bf16_weights_follow_torch_and_keep_bf16_states(name, rounding):
    """bf16 weights (and Muon's momentum) written with stochastic rounding or Kahan stay within the family's bf16
    tolerance of torch.optim's float64 run from the same start after 5 steps; every per-element state is bf16."""
    ours, theirs, shapes, groups = ALGORITHMS[name]
    init = _init(shapes, torch.bfloat16)
    got, opt = _run(ours, init, groups, 5, rounding=rounding, seed=0)
    expected, _ = _run(theirs, [p.double() for p in init], groups, 5)
    tol = TOLERANCES[torch.bfloat16]
    for a, b in zip(got, expected):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.double(), b.detach(), rtol=tol.rtol, atol=tol.atol)
    kept = {k: v for p in got for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and v.ndim}
    assert set(kept) == ({"exp_avg"} if name == "muon" else set()) | ({"kahan_comp"} if rounding == "kahan" else set())
    assert all(v.dtype == torch.bfloat16 for v in kept.values())


@pytest.mark.parametrize("rounding", ["stochastic", "kahan", "nearest"])
def test_muons_bf16_write_is_the_same_bytes_on_every_backend(rounding):
    # The orthogonalized momentum is bf16: the fused kernels (Triton through its interpreter, the C++ loop) write it
    # as the PyTorch path does, weights and Kahan remainders byte for byte, decay and both groups' step sizes included.
    from lightning_pure_bf16.optim import fused_cpu_available

    pytest.importorskip("triton")
    _, _, shapes, groups = ALGORITHMS["muon"]
    backends = ["torch", "triton", *(["cpu"] if fused_cpu_available() else [])]
    results = {}
    for backend in backends:
        params, opt = _run(Muon, _init(shapes, torch.bfloat16), groups, 3, rounding=rounding, seed=5, backend=backend)
        states = [v for p in params for k, v in sorted(opt.state[p].items()) if isinstance(v, torch.Tensor) and v.ndim]
        results[backend] = [t.detach().reshape(-1).view(torch.int16) for t in (*params, *states)]
    reference = results.pop("torch")
    assert len(results) == len(backends) - 1
    for backend, got in results.items():
        assert all(torch.equal(a, b) for a, b in zip(got, reference)), backend


@pytest.mark.parametrize("name", ALGORITHMS)
def test_updates_of_a_tenth_of_an_ulp_move_the_weights_stochastically_only(name):
    """Steps far below half a bf16 spacing: stochastic rounding moves the weights by their average, nearest leaves
    them where they are."""
    ours, _, shapes, _ = ALGORITHMS[name]
    w = torch.full(shapes[0], 1.0)
    lr = {"adafactor": 5e-4, "muon": 3e-3}[name]  # steps of 1/16 to 1/10 of the spacing at 1.0 (2**-7)
    moved = {}
    for rounding in ("stochastic", "nearest"):
        p = w.bfloat16().requires_grad_()
        opt = ours([p], lr=lr, weight_decay=0.0, rounding=rounding, seed=1)
        if name == "adafactor":
            opt.param_groups[0]["eps"] = (None, 1.0)  # a relative step of lr exactly, whatever the weight
        for _t in range(50):
            p.grad = torch.ones_like(p)
            opt.step()
        moved[rounding] = float((w - p.detach().float()).mean())
    ref = w.clone().requires_grad_()
    ref_opt = ours([ref], lr=lr, weight_decay=0.0)
    if name == "adafactor":
        ref_opt.param_groups[0]["eps"] = (None, 1.0)
    for _t in range(50):
        ref.grad = torch.ones_like(ref)
        ref_opt.step()
    expected = float((w - ref.detach()).mean())
    assert expected > 0.003
    assert abs(moved["stochastic"] - expected) < 0.15 * expected
    assert moved["nearest"] == 0.0


def _flat_run(cls, shapes, groups_kw, steps, pieces_of_rank, rank, **kw):
    """The parameters of ``shapes`` laid out as ZeRO-3 lays a sub-group out on ``rank`` (one flat float32 tensor
    per group), stepped ``steps`` times; returns each parameter's run."""
    full = _init(shapes)
    half = len(shapes) // 2
    flats, descriptions = [], []
    for members in (range(half), range(half, len(shapes))):
        pieces = pieces_of_rank([shapes[i] for i in members], rank)
        flat = torch.zeros(sum(q.span for q in pieces.pieces))
        for i, q in zip(members, pieces.pieces):
            flat[q.offset : q.offset + q.numel] = full[i].reshape(-1)[q.start : q.start + q.numel]
        flats.append(flat.view(1, -1).requires_grad_())  # two dimensions: Muon's construction takes matrices
        descriptions.append(pieces)
    opt = cls([{"params": [f], **g} for f, g in zip(flats, groups_kw)], **kw)
    for f, d in zip(flats, descriptions):
        opt.set_pieces(f, d)
    for t in range(steps):
        for members, f, d in zip((range(half), range(half, len(shapes))), flats, descriptions):
            grad = torch.zeros(f.numel())
            for i, q in zip(members, d.pieces):
                grad[q.offset : q.offset + q.numel] = _grad(shapes[i], t, i).reshape(-1)[q.start : q.start + q.numel]
            f.grad = grad.view(f.shape)
        opt.step()
    out = []
    for f, d in zip(flats, descriptions):
        out += [f.detach().view(-1)[q.offset : q.offset + q.numel].clone() for q in d.pieces]
    return out


def _zero3_pieces(world, group=None):
    def make(shapes, rank):
        return pieces_mod.zero3(
            [(f"p{i}", s, torch.Size(s).numel(), -(-torch.Size(s).numel() // world)) for i, s in enumerate(shapes)],
            rank,
            group,
        )

    return make


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_tensor_holding_several_parameters_steps_each_as_its_own(name):
    """A flat tensor holding several parameters one after the other (a ZeRO-3 partition on one rank) is stepped as
    the parameters themselves: the statistics and matrices are each parameter's own."""
    ours, _, shapes, groups = ALGORITHMS[name]
    ref, _ = _run(ours, _init(shapes), groups, 5)
    runs = _flat_run(ours, shapes, groups, 5, _zero3_pieces(1), 0)
    for run, p in zip(runs, ref):
        torch.testing.assert_close(run, p.detach().reshape(-1), rtol=2e-6, atol=2e-6)


def _dtensor_run(cls, shapes, groups_kw, steps):
    """The parameters of ``shapes`` as FSDP2 shards them over every rank (``Shard(0)``), stepped ``steps`` times;
    returns the whole parameters."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = [torch.nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])) for p in _init(shapes)]
    half = len(params) // 2
    opt = cls([{"params": params[:half], **groups_kw[0]}, {"params": params[half:], **groups_kw[1]}])
    for t in range(steps):
        for i, p in enumerate(params):
            p.grad = distribute_tensor(_grad(p.shape, t, i), mesh, [Shard(0)])
        opt.step()
    return [p.detach().full_tensor().reshape(-1) for p in params]


LAYOUTS = ("zero3", "fsdp2")


def _two_ranks(rank, out):
    """Every algorithm in every layout, one after the other in the same two processes (one start for all)."""
    dist.init_process_group("gloo", init_method=f"file://{out / 'store'}", rank=rank, world_size=2)
    try:
        for name, (ours, _, shapes, groups) in ALGORITHMS.items():
            for layout in LAYOUTS:
                if layout == "zero3":
                    runs = _flat_run(ours, shapes, groups, 5, _zero3_pieces(2, dist.group.WORLD), rank)
                else:
                    runs = _dtensor_run(ours, [s for s in shapes if s], groups, 5)
                torch.save(runs, out / f"{name}_{layout}_rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_two_ranks, args=(r, out)) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=300)
        assert proc.exitcode == 0
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ALGORITHMS)
def test_two_ranks_holding_halves_of_each_parameter_step_it_as_one_process(name, layout, two_rank_runs):
    """Two processes, each holding the half of every parameter ZeRO-3 would give it (a run cutting across rows, the
    last one padded) or FSDP2 would (a DTensor's rows): the ranks' summed statistics (Adafactor) and the owner's
    orthogonalization (Muon) give the update of the whole parameters in one process."""
    ours, _, shapes, groups = ALGORITHMS[name]
    if layout == "fsdp2":
        shapes = [s for s in shapes if s]  # a 0-dim tensor cannot be sharded by rows
    ref, _ = _run(ours, _init(shapes), groups, 5)
    results = [torch.load(two_rank_runs / f"{name}_{layout}_rank{r}.pt") for r in range(2)]
    for i, p in enumerate(ref):
        whole = torch.cat([results[0][i], results[1][i]]) if layout == "zero3" else results[1][i]
        torch.testing.assert_close(whole, p.detach().reshape(-1), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_a_resumed_run_equals_an_uninterrupted_one_and_torch_state_dicts_load(name):
    """bf16 with stochastic rounding: 3 steps, a state dict through bytes, 3 more steps equal 6 steps bit for bit
    (float32 statistics kept float32); torch.optim's own state dict loads and continues its run."""
    ours, theirs, shapes, groups = ALGORITHMS[name]
    init = _init(shapes, torch.bfloat16)
    whole, _ = _run(ours, init, groups, 6, seed=9)
    first, opt = _run(ours, init, groups, 3, seed=9)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    params = [p.detach().clone().requires_grad_() for p in first]
    half = len(params) // 2
    resumed = ours([{"params": params[:half], **groups[0]}, {"params": params[half:], **groups[1]}], seed=1)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    if name == "adafactor":
        assert resumed.state[params[0]]["statistics"]["row_var"].dtype == torch.float32
    _run(ours, params, groups, 3, start=3, opt=resumed)
    assert all(torch.equal(a, b) for a, b in zip(whole, params))

    ref, ref_opt = _run(theirs, _init(shapes), groups, 3)
    converted = [p.detach().clone().requires_grad_() for p in ref]
    mine = ours([{"params": converted[:half], **groups[0]}, {"params": converted[half:], **groups[1]}])
    mine.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
    _run(theirs, ref, groups, 2, start=3, opt=ref_opt)
    _run(ours, converted, groups, 2, start=3, opt=mine)
    for p, q in zip(converted, ref):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_an_inf_gradient_skips_the_whole_step(name):
    ours, _, shapes, groups = ALGORITHMS[name]
    params, opt = _run(ours, _init(shapes, torch.bfloat16), groups, 2)
    before = [p.detach().clone() for p in params]
    states = copy.deepcopy([opt.state[p] for p in params])
    for i, p in enumerate(params):
        p.grad = _grad(p.shape, 9, i).bfloat16()
    params[-1].grad.view(-1)[0] = float("inf")
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert all(int(opt.state[p]["step"]) == int(s["step"]) for p, s in zip(params, states))


def test_muon_with_adamw_groups_computes_torchs_muon_and_adamw_together():
    """Muon on the matrices and AdamW (``use_muon=False``) on the rest, on float32: what torch's Muon and AdamW
    compute on the same groups (tests/reference/muon.py), a scheduler's lr included."""
    from tests.reference.muon import ReferenceMuonAdamW

    shapes = [(6, 5), (4, 9), (7,), (3, 5)]
    groups = [{"lr": 2e-2}, {"use_muon": False, "lr": 1e-3, "weight_decay": 0.0}]
    results = []
    for cls in (Muon, ReferenceMuonAdamW):
        params = [p.clone().requires_grad_() for p in _init(shapes)]
        opt = cls([{"params": params[:2], **groups[0]}, {"params": params[2:], **groups[1]}], adjust_lr_fn="original")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        for t in range(4):
            for i, p in enumerate(params):
                p.grad = _grad(p.shape, t, i)
            opt.step()
            sched.step()
        results.append(params)
    for p, q in zip(*results):
        torch.testing.assert_close(p, q, rtol=2e-6, atol=2e-6)


def test_muon_steps_its_adamw_groups_as_adamw():
    """A group with ``use_muon=False`` (or ``algorithm="adamw"``) is AdamW with DeepSpeed's MuonWithAuxAdam defaults
    (betas (0.9, 0.95), eps 1e-10): bit for bit this package's AdamW on the same tensors."""
    from lightning_pure_bf16 import AdamW

    init = _init([(7,), (5, 3)], torch.bfloat16)
    groups = [{"use_muon": False, "lr": 1e-3}, {"algorithm": "adamw", "weight_decay": 0.0}]
    a, opt = _run(Muon, init, groups, 4, seed=2)
    b, _ = _run(
        AdamW,
        init,
        [{"lr": 1e-3, "weight_decay": 0.1}, {"weight_decay": 0.0, "lr": 1e-3}],
        4,
        seed=2,
        betas=(0.9, 0.95),
        eps=1e-10,
    )
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert set(opt.state[a[0]]) >= {"exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: Muon([p[0]]), "Muon steps matrices only"),
        (lambda p: Muon([p[1]], ns_steps=100), "ns_steps"),
        (lambda p: Muon([{"params": [p[0]], "algorithm": "lion"}]), "algorithm"),
        (lambda p: Muon([{"params": [p[0]], "algorithm": "adamw", "use_muon": True}]), "give one of them"),
        (lambda p: Muon([p[1]], adjust_lr_fn="spectral"), "adjust_lr_fn"),
        (lambda p: Muon([p[1]], moments="int8"), "moments"),
        (lambda p: Adafactor(p, beta2_decay=0.5), "beta2_decay"),
        (lambda p: Adafactor(p, eps=(None, -1.0)), "eps"),
        (lambda p: Adafactor(p, state_storage="mmap", state_dir="."), "state_storage"),
    ],
)
def test_bad_options_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make([torch.zeros(4, requires_grad=True), torch.zeros(3, 4, requires_grad=True)])


def test_muon_param_groups_orthogonalize_the_hidden_matrices_and_give_the_rest_to_adamw():
    from lightning_pure_bf16 import muon_param_groups

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(16, 8)  # an embedding by type, whatever its name
            self.hidden = torch.nn.Linear(8, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.lm_head = torch.nn.Linear(8, 16, bias=False)
            self.conv = torch.nn.Conv1d(8, 8, 3)  # not a matrix
            self.frozen = torch.nn.Linear(8, 8)
            self.frozen.requires_grad_(False)

    model = Tiny().to(torch.bfloat16)
    muon, adamw = muon_param_groups(model, lr=3e-4, betas=(0.8, 0.9))
    assert [id(p) for p in muon["params"]] == [id(model.hidden.weight)] and "use_muon" not in muon
    expected = [model.wte.weight, model.hidden.bias, model.norm.weight, model.norm.bias, model.lm_head.weight]
    expected += [model.conv.weight, model.conv.bias]
    assert [id(p) for p in adamw["params"]] == [id(p) for p in expected]
    assert adamw["use_muon"] is False and adamw["lr"] == 3e-4 and adamw["betas"] == (0.8, 0.9)
    opt = Muon(muon_param_groups(model), lr=2e-2)  # accepted as built: every Muon parameter a matrix
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]


def test_muon_reads_the_layer_shape_of_a_parameter_zero3_partitioned_at_construction():
    # Under deepspeed.zero.Init (Fabric's init_module, from_pretrained under ZeRO-3) a parameter is an empty
    # placeholder whose shape as a layer is ds_shape: a matrix there is accepted, a vector still refused by name.
    matrix, vector = (torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16)) for _ in range(2))
    matrix.ds_shape, vector.ds_shape = torch.Size([8, 4]), torch.Size([8])
    Muon([matrix])
    with pytest.raises(ValueError, match=r"a parameter of shape \(8,\) is in a Muon group"):
        Muon([vector])


@pytest.mark.parametrize("name", ALGORITHMS)
def test_slices_for_gradient_release_are_refused(name):
    ours, *_ = ALGORITHMS[name]
    p = torch.zeros(4, 4, dtype=torch.bfloat16, requires_grad=True)
    opt = ours([p])
    opt.init_states([(p, opt.param_groups[0])])
    with pytest.raises(ValueError, match="gradient release"):
        opt.update_slice(p, opt.param_groups[0], torch.zeros(8, dtype=torch.bfloat16), 0)
