"""Runs you can repeat. Mid-epoch resume with shuffled data: the resumed run trains on the batches the uninterrupted
one did, bit for bit, with a plain ``DataLoader`` and torchdata's ``StatefulDataLoader``, through the Trainer and
through Fabric. Two fits in one process after the same seed are the same run."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.trainer.connectors.data_connector import _get_distributed_sampler
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lightning_pure_bf16.data import distributed_sampler_by_seed, resume_dataloader
from tests.strategy_runs import assert_same_partitions, fit_runs, load_ranks

# 256 samples, batch 16, 2 ranks: 8 steps per epoch. A checkpoint at step 12 is in the middle of the second epoch (the
# sampler's epoch matters), and the run goes on across the next epoch boundary (step 16).
RUN = {
    "devices": 2,
    "strategy": {"rounding": "kahan"},
    "scheduler": True,
    "nan_rank": 0,
    "nan_step": 2,
    "shuffle": True,
}
CKPT_STEP, STEPS = 12, 18


def _assert_same_run_from(whole: list[dict], resumed: list[dict], step: int) -> None:
    for a, b in zip(whole, resumed):
        assert b["first_inputs"] == a["first_inputs"][step:]  # the same batches, in the same order
        assert b["losses"] == a["losses"][step:]
        assert_same_partitions(a, b)


LOADERS = {"DataLoader": False, "StatefulDataLoader": True}


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """One launch: for each loader an uninterrupted fit with checkpoints and a fit resumed from its mid-epoch one;
    then two short fits after the same seed."""
    out = tmp_path_factory.mktemp("trainer")
    runs = []
    for loader, stateful in LOADERS.items():
        ckpt = out / f"whole_{loader}" / "ckpts" / f"epoch=1-step={CKPT_STEP}.ckpt"
        runs.append({"name": f"whole_{loader}", "ckpt_every": 4, "stateful_data": stateful})
        runs.append({"name": f"resumed_{loader}", "ckpt_path": str(ckpt), "stateful_data": stateful})
    runs += [{"name": name, "steps": 4, "nan_rank": None} for name in ("first", "second")]
    return fit_runs(out, runs, steps=STEPS, **RUN)


@pytest.fixture(scope="module")
def fabric_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fabric")
    runs = []
    for loader, stateful in LOADERS.items():
        ckpt = str(out / f"mid_{loader}.ckpt")
        runs.append({"name": f"whole_{loader}", "save_at": CKPT_STEP, "save_path": ckpt, "stateful_data": stateful})
        runs.append({"name": f"resumed_{loader}", "resume": ckpt, "stateful_data": stateful})
    runs += [{"name": name, "steps": 4} for name in ("first", "second")]
    shared = {"devices": 2, "steps": STEPS, "shuffle": True, "strategy": {"rounding": "kahan"}}
    return fit_runs(out, runs, script="fabric_mlp.py", **shared)


@pytest.mark.parametrize("loader", LOADERS)
def test_trainer_resumes_a_shuffled_epoch_mid_way_bit_for_bit(trainer_runs, loader):
    whole, resumed = (load_ranks(trainer_runs / f"{name}_{loader}") for name in ("whole", "resumed"))
    _assert_same_run_from(whole, resumed, CKPT_STEP)


@pytest.mark.parametrize("loader", LOADERS)
def test_fabric_loop_resumes_a_shuffled_epoch_mid_way_bit_for_bit(fabric_runs, loader):
    whole, resumed = (load_ranks(fabric_runs / f"{name}_{loader}") for name in ("whole", "resumed"))
    assert whole[0]["first_inputs"] != whole[1]["first_inputs"]  # each rank its own share
    _assert_same_run_from(whole, resumed, CKPT_STEP)


def _torchdata_loader(**kwargs) -> DataLoader:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(torch.arange(64.0), batch_size=4, **kwargs)


def _batches(loader) -> list[list[float]]:
    return [b.tolist() for b in loader]


def test_lightning_wraps_torchdatas_random_sampler_and_we_reshuffle_it_by_seed():
    loader = _torchdata_loader(shuffle=True)
    # The upstream behaviour worked around: torch's RandomSampler gets a DistributedSampler (order from seed and
    # epoch); torchdata's is wrapped, and the order comes from its generator, wherever that generator is.
    wrapped = _get_distributed_sampler(loader, shuffle=True, overfit_batches=0, num_replicas=2, rank=0, seed=3)
    assert type(wrapped).__name__ == "DistributedSamplerWrapper"
    from lightning.fabric.utilities.data import _update_dataloader

    injected = _update_dataloader(loader, wrapped)
    torch.manual_seed(0)
    first = _batches(injected)
    assert _batches(injected) != first  # the next pass of the same epoch is another order

    fixed = distributed_sampler_by_seed(injected)
    sampler = fixed.batch_sampler.sampler
    assert type(sampler) is DistributedSampler and sampler.seed == 3 and sampler.shuffle
    reference = DistributedSampler(range(64), num_replicas=2, rank=0, shuffle=True, seed=3)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        reference.set_epoch(epoch)
        expected = [float(i) for i in reference]
        assert sum(_batches(fixed), []) == expected
        assert sum(_batches(fixed), []) == expected  # the same again: nothing but seed and epoch decides


def test_other_samplers_are_left_as_they_are():
    plain = DataLoader(torch.arange(8.0), batch_size=2, shuffle=True)
    assert distributed_sampler_by_seed(plain) is plain
    from lightning.fabric.utilities.data import _update_dataloader
    from torchdata.stateful_dataloader.sampler import RandomSampler

    with_replacement = _torchdata_loader(sampler=RandomSampler(range(64), replacement=True))

    sampler = _get_distributed_sampler(with_replacement, shuffle=True, overfit_batches=0, num_replicas=2, rank=0)
    injected = _update_dataloader(with_replacement, sampler)
    assert distributed_sampler_by_seed(injected) is injected


def test_a_plain_loader_resumes_after_the_trained_batches_of_its_epoch_then_whole_epochs():
    sampler = DistributedSampler(range(40), num_replicas=2, rank=1, shuffle=True, seed=5)
    loader = DataLoader(torch.arange(40.0), batch_size=3, sampler=sampler)
    resumed = resume_dataloader(loader, epoch=2, batches_done=4, who="test")
    sampler.set_epoch(2)
    epoch2 = _batches(loader)
    assert _batches(resumed) == epoch2[4:]
    assert len(resumed) == len(loader)  # Lightning counts the trained batches itself
    resumed.sampler.set_epoch(3)
    sampler.set_epoch(3)
    assert _batches(resumed) == _batches(loader)


def test_a_loader_that_cannot_be_fast_forwarded_warns_at_resume():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    loader = DataLoader(Stream(), batch_size=2)
    with pytest.warns(UserWarning, match="cannot be fast-forwarded.*StatefulDataLoader"):
        assert (
            resume_dataloader(loader, epoch=0, batches_done=2, who="Trainer(strategy='deepspeed_pure_bf16')") is loader
        )


def test_a_single_process_random_sampler_warns_at_resume_instead_of_skipping_another_order():
    loader = DataLoader(torch.arange(8.0), batch_size=2, shuffle=True)
    with pytest.warns(UserWarning, match="RandomSampler.*draws anew"):
        assert resume_dataloader(loader, epoch=0, batches_done=1, who="test") is loader


def test_resume_fabric_dataloader_refuses_a_negative_position_and_a_loader_fabric_did_not_set_up():
    from lightning_pure_bf16 import resume_fabric_dataloader

    loader = DataLoader(torch.arange(8.0), batch_size=2)
    with pytest.raises(TypeError, match="setup_dataloaders"):
        resume_fabric_dataloader(loader, epoch=1, batches_done=0)
    with pytest.raises(ValueError, match="must be >= 0"):
        resume_fabric_dataloader(loader, epoch=-1, batches_done=0)


# ------------------------------------------------------------------------------------------------- reseeded runs
@pytest.mark.parametrize("front_end", ["trainer", "fabric"])
def test_two_fits_in_one_process_after_the_same_seed_are_bit_identical(trainer_runs, fabric_runs, front_end):
    # As a notebook, a sweep or a k-fold loop runs them: the fixtures' runs share one process on each rank.
    out = trainer_runs if front_end == "trainer" else fabric_runs
    for first, second in zip(*(load_ranks(out / name) for name in ("first", "second"))):
        assert first["seed"] == second["seed"]
        assert first["losses"] == second["losses"]
        for x, y, real in zip(first["flat_params"], second["flat_params"], first["real_masks"]):
            assert torch.equal(x[real], y[real])
        for sa, sb, real in zip(first["state"].values(), second["state"].values(), first["real_masks"]):
            assert torch.equal(sa["exp_avg"][real], sb["exp_avg"][real])
            assert torch.equal(sa["exp_avg_sq"][real], sb["exp_avg_sq"][real])
