"""Fits a small MLP with the pure-bf16 strategy and writes what the tests check to OUT/rank{R}.pt.

Run as a script (Lightning's subprocess launcher starts the other ranks by re-running it):
    python tests/scripts/fit_mlp.py OUT '{"devices": 2, "steps": 6}'
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch

try:  # run as a script (this folder on the path), or imported as tests.scripts.fit_mlp by a test
    from _inspect import reachable_tensors, record_sub_group_steps
    from _models import MLP as Layers
    from _models import data, param_groups, partitions
    from _runs import run_all
except ImportError:
    from tests.scripts._inspect import reachable_tensors, record_sub_group_steps
    from tests.scripts._models import MLP as Layers
    from tests.scripts._models import data, param_groups, partitions
    from tests.scripts._runs import run_all
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader

import lightning_pure_bf16
from lightning_pure_bf16 import DeepSpeedPureBF16Strategy
from lightning_pure_bf16.memory import is_file_backed


class SaveAtStart(Callback):
    """Saves the state a resume restored, before the first step (a checkpoint loaded and saved again at once)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module):
        trainer.save_checkpoint(self.path)


class KillRankAtStep(Callback):
    """SIGKILL to one rank in the middle of training, after the backward of a step's batch, outside any save: no
    clean-up, no exception, as the kernel's out-of-memory killer or a lost node ends it."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


class CaptureOptimizerState(Callback):
    """What the optimizer holds at the end of training, before the strategy's teardown closes "mmap" state files."""

    def __init__(self) -> None:
        self.captured: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if "cpu_loop_ready_at_first_step" not in self.captured:
            import lightning_pure_bf16.ops.update_cpu as update_cpu

            self.captured["cpu_loop_ready_at_first_step"] = update_cpu._extension is not None

    def on_train_end(self, trainer, pl_module) -> None:
        strat = trainer.strategy
        opt = strat.pure_bf16_optimizer
        self.captured["state"] = {
            k: {kk: vv.clone() if isinstance(vv, torch.Tensor) else vv for kk, vv in v.items()}
            for k, v in enumerate(opt.state.values())
        }
        self.captured["state_files"] = [
            {kk: vv.untyped_storage().filename for kk, vv in v.items() if isinstance(vv, torch.Tensor) and vv.ndim}
            for v in opt.state.values()
        ]
        self.captured["state_dir"] = opt.state_dir
        self.captured["memory_report"] = strat.memory_report()
        self.captured["zero_buffers"] = [
            (name, t.dtype, t.untyped_storage().nbytes(), is_file_backed(t))
            for name, t in reachable_tensors(strat.deepspeed_engine.optimizer, "zero", max_depth=7)
        ]


class CountGathered(Callback):
    """The most elements of parameters ZeRO-3 holds gathered at once in each training step, sampled as each module's
    forward and backward start, after ZeRO-3's own hooks have gathered (and prefetched) what it needs. Persistent
    parameters, always whole on every rank, are left out. Beside it, the most elements of full-size gradients not yet
    reduce-scattered, sampled as each module's backward starts (after the later layers' gradients were computed)."""

    def __init__(self) -> None:
        self.counts: list[int] = []
        self.grad_counts: list[int] = []
        self._most = self._most_grads = 0

    def _sample(self, *_) -> None:
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

        held = sum(
            p.ds_numel
            for p in self._params
            if p.ds_status in (ZeroParamStatus.AVAILABLE, ZeroParamStatus.INFLIGHT) and not p.ds_persist
        )
        self._most = max(self._most, held)

    def _sample_backward(self, *args) -> None:
        self._sample()
        grads = sum(p.ds_numel for p in self._params if p.grad is not None and p.grad.numel() == p.ds_numel)
        self._most_grads = max(self._most_grads, grads)

    def on_train_start(self, trainer, pl_module) -> None:
        self._params = list(pl_module.parameters())
        for module in pl_module.modules():
            module.register_forward_pre_hook(self._sample)
            module.register_full_backward_pre_hook(self._sample_backward)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._most = self._most_grads = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.counts.append(self._most)
        self.grad_counts.append(self._most_grads)


class MLP(LightningModule):
    def __init__(self, opts: dict) -> None:
        super().__init__()
        self.opts = opts
        self.loaded_partitions = None
        if opts.get("pretrained"):  # built, partitioned, and loaded in configure_model
            self.net = None
            return
        self.net = Layers(opts.get("hidden", 64), opts.get("depth", 1), opts.get("bias", True)).net
        if opts.get("freeze_first"):
            self.net[0].requires_grad_(False)
        for layer in [m for m in self.net if isinstance(m, nn.Linear)][: opts.get("freeze_layers", 0)]:
            layer.requires_grad_(False)
        self._lists()

    def _lists(self) -> None:
        self.lrs: list[float] = []
        self.losses: list[float] = []
        self.first_inputs: list[float] = []

    def configure_model(self) -> None:
        if self.net is not None:
            return
        self._lists()
        self.net = Layers(self.opts.get("hidden", 64), self.opts.get("depth", 1), self.opts.get("bias", True)).net
        self.pretrained_load = lightning_pure_bf16.load_pretrained(
            self, self.opts["pretrained"], key_map=self.opts.get("key_map")
        )
        self.loaded_partitions = partitions(self)

    def on_train_end(self) -> None:
        if self.opts.get("save_pretrained"):  # every rank, the run's partitions still live
            lightning_pure_bf16.save_pretrained(
                self, self.opts["save_pretrained"], key_map={"net.": ""}, max_shard_size=3000
            )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x).float(), y.float())
        if self.opts.get("user_warning"):
            warnings.warn(f"a user's own warning at step {self.global_step}", UserWarning, stacklevel=1)
        nan_rank = self.opts.get("nan_rank")
        if nan_rank is not None and self.global_rank == nan_rank and self.global_step == self.opts.get("nan_step", 2):
            loss = loss * float("nan")
        self.losses.append(loss.item())
        self.first_inputs.append(float(x[0, 0]))
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x).float(), y.float()), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self.net(x).float(), y.float()), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        kind = self.opts.get("optimizer", "torch_adamw")
        groups = param_groups(self.net)
        if kind == "torch_adamw":
            opt = torch.optim.AdamW(groups, lr=1e-2)
        elif kind == "torch_adam":
            opt = torch.optim.Adam(groups, lr=1e-2)
        elif kind == "torch_amsgrad":
            opt = torch.optim.AdamW(groups, lr=1e-2, amsgrad=True)
        elif kind == "torch_rmsprop":
            opt = torch.optim.RMSprop(groups, lr=1e-2)
        elif kind == "torch_sgd":
            opt = torch.optim.SGD(groups, lr=1e-2, momentum=0.9, nesterov=True)
        elif kind == "lion":
            opt = lightning_pure_bf16.Lion(groups, lr=1e-3, moments="int8")
        elif kind == "torch_adafactor":
            opt = torch.optim.Adafactor(groups, lr=1e-2)
        elif kind == "muon":  # the matrices by Muon, the biases by AdamW
            opt = lightning_pure_bf16.Muon([groups[0], {**groups[1], "use_muon": False, "lr": 1e-3}], lr=2e-2)
        elif kind == "pure":
            opt = lightning_pure_bf16.AdamW(groups, lr=1e-2, rounding="kahan")
        else:
            raise ValueError(kind)
        if not self.opts.get("scheduler"):
            return opt
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main(out: Path, opts: dict) -> None:
    if opts.get("no_alias_fix"):
        import contextlib

        import lightning_pure_bf16._internals as internals

        internals.alias_bf16_master_partitions = lambda **_: contextlib.nullcontext()  # DeepSpeed's construction as is
    if opts.get("fake_free_bytes") is not None:
        import shutil

        import lightning_pure_bf16.optim.mmap_states as mmap_states

        free = opts["fake_free_bytes"]
        mmap_states.shutil.disk_usage = lambda _: shutil._ntuple_diskusage(10 * free + 1, 9 * free + 1, free)
    if opts.get("deepspeed_picked_cuda"):
        # What DeepSpeed picks by itself on a machine with a GPU, whatever the Trainer's accelerator.
        from deepspeed.accelerator import set_accelerator
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        set_accelerator(CUDA_Accelerator())
    if opts.get("record_exit"):
        _record_process_group_at_exit(out)
    grad_storage = _record_step_gradient_storage() if opts.get("record_grad_storage") else None
    seed_everything(opts.get("seed", 1234), workers=True)
    model = MLP(opts)
    strategy = opts.get("strategy", "deepspeed_pure_bf16")
    if isinstance(strategy, dict):
        strategy = DeepSpeedPureBF16Strategy(**strategy)
    capture = CaptureOptimizerState()
    trainer = Trainer(
        accelerator=opts.get("accelerator", "cpu"),
        devices=opts.get("devices", 2),
        num_nodes=opts.get("num_nodes", 1),
        strategy=strategy,
        # A precision plugin and a precision flag exclude each other.
        precision=None if "cpu_matmul" in opts else opts.get("precision", "32-true"),
        plugins=[lightning_pure_bf16.PureBF16Precision(cpu_matmul=opts["cpu_matmul"])] if "cpu_matmul" in opts else [],
        max_steps=opts.get("steps", 6),
        limit_val_batches=2,
        gradient_clip_val=opts.get("clip"),
        accumulate_grad_batches=opts.get("accumulate", 1),
        logger=CSVLogger(out, name="logs"),
        enable_checkpointing=bool(opts.get("ckpt_every")),
        callbacks=[capture]
        + ([SaveAtStart(opts["save_at_start"])] if opts.get("save_at_start") else [])
        + ([KillRankAtStep(*opts["kill_rank_at_step"])] if opts.get("kill_rank_at_step") else [])
        + (
            [ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=opts["ckpt_every"], save_top_k=-1)]
            if opts.get("ckpt_every")
            else []
        ),
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
    )
    if opts.get("stateful_data"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
        loader = StatefulDataLoader(data(), batch_size=16, shuffle=bool(opts.get("shuffle")))
    else:
        loader = DataLoader(data(), batch_size=16, shuffle=bool(opts.get("shuffle")))
    if opts.get("init_weights"):
        from safetensors.torch import load_file

        model.to(torch.bfloat16).load_state_dict(load_file(opts["init_weights"]), strict=True)
        result_init = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(result_init, out / "init_weights_loaded.pt")
    if opts.get("kill_during_save"):
        _kill_after_first_staged_file()
    update_calls = _count_update_calls() if opts.get("count_updates") else None
    if opts.get("record_gathered"):
        counter = CountGathered()
        trainer.callbacks.append(counter)
    val_loader = DataLoader(data(), batch_size=16, shuffle=False)
    trainer.fit(model, loader, val_loader, ckpt_path=opts.get("ckpt_path"))
    if opts.get("save_at_end"):
        trainer.save_checkpoint(opts["save_at_end"])
    if "state" not in capture.captured:  # a resumed fit with nothing left to do ends before on_train_end
        capture.on_train_end(trainer, model)
    strat = trainer.strategy
    zero = strat.deepspeed_engine.optimizer
    flat = [t.detach().clone() for t in zero.fp16_partitioned_groups_flat]
    # ZeRO-3 pads each parameter's partition; the padding is uninitialised memory, so compare real elements only.
    real_masks = []
    for group in zero.fp16_groups:
        parts = []
        for param in group:
            pn = param.partition_numel()
            real = max(0, min(pn, param.ds_numel - trainer.global_rank * pn))
            parts.append(torch.arange(pn) < real)
        real_masks.append(torch.cat(parts))
    opt = strat.pure_bf16_optimizer
    result = {
        "rank": trainer.global_rank,
        "flat_params": flat,
        "real_masks": real_masks,
        "state": capture.captured["state"],
        "state_files": capture.captured["state_files"],
        "state_dir": capture.captured["state_dir"],
        "optimizer_class": type(opt).__name__,
        "rounding": [g["rounding"] for g in opt.param_groups],
        "group_wd": [g["weight_decay"] for g in opt.param_groups],
        "seed": opt.seed,
        "skipped_steps": opt.skipped_steps,
        "memory_report": capture.captured["memory_report"],
        "losses": model.losses,
        "first_inputs": model.first_inputs,
        "lrs": model.lrs,
        "global_step": trainer.global_step,
        "precision": type(strat.precision_plugin).__name__,
        "frozen_requires_grad": [p.requires_grad for p in model.net[0].parameters()],
        "loaded_partitions": model.loaded_partitions,
    }
    result["zero_buffers"] = capture.captured["zero_buffers"]
    result["cpu_loop_ready_at_first_step"] = capture.captured.get("cpu_loop_ready_at_first_step")
    result["gradient_clipping"] = strat.deepspeed_engine.gradient_clipping()
    result["peak_memory"] = strat.peak_memory()
    result["world_size"] = trainer.world_size
    from deepspeed.accelerator import get_accelerator

    result["deepspeed_accelerator"] = get_accelerator().device_name()
    result["process_group_backend"] = torch.distributed.get_backend()
    result["persistent_numel"] = sum(p.numel() for p in zero.parameter_offload.persistent_parameters)
    if opts.get("eval_loops"):
        result["validate"] = trainer.validate(model, loader, verbose=False)
        result["test"] = trainer.test(model, loader, verbose=False)
        preds = trainer.predict(model, DataLoader(data(32), batch_size=16))
        result["predict_shapes"] = [tuple(p.shape) for p in preds]
        result["predict_finite"] = all(bool(torch.isfinite(p.float()).all()) for p in preds)
    if grad_storage is not None:
        result["step_grad_is_partition_view"] = grad_storage
    if update_calls is not None:
        result["update_calls"] = list(update_calls)
        result["sub_groups"] = len(zero.fp16_groups)
        result["sub_group_numels"] = [t.numel() for t in zero.fp32_partitioned_groups_flat]
    if opts.get("record_gathered"):
        result["most_gathered_per_step"] = counter.counts
        result["most_unreduced_grads_per_step"] = counter.grad_counts
        result["largest_partitioned_numel"] = max(p.ds_numel for p in model.parameters() if not p.ds_persist)
    if opt.whole_parameter:  # what the optimizer was told each flat partition holds
        result["pieces"] = [
            [(q.name, q.shape, q.start, q.offset, q.numel) for q in opt.pieces_of(f).pieces]
            for f in zero.fp32_partitioned_groups_flat
        ]
        result["statistics"] = [opt.state[f].get("statistics") for f in zero.fp32_partitioned_groups_flat]
    if opts.get("gather_full") or opt.whole_parameter:
        import deepspeed

        params = dict(model.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            full = {k: v.detach().clone() for k, v in model.state_dict().items()}
        result["full_state"] = full
    torch.save(result, out / f"rank{trainer.global_rank}.pt")
    # Nothing is torn down here, as in a user's script: the strategy destroys the process group it made at exit.


def _record_step_gradient_storage() -> list:
    """At each sub-group's update: where the gradient the optimizer gets lives, and where ZeRO-3's gradient partition
    does (the data pointers of their storages)."""
    seen = []

    def record(zero, master, kwargs):  # noqa: ANN001, ANN202
        buffer = zero.grad_partitions_flat_buffer
        seen.append((master.grad.untyped_storage().data_ptr(), buffer.untyped_storage().data_ptr()))

    record_sub_group_steps(record)
    return seen


def _record_process_group_at_exit(out: Path) -> None:
    """Registered before the fit, so it runs after every exit handler the fit registers (last in, first out): writes
    whether a process group was still alive when the interpreter was about to finalize."""
    import atexit

    def record() -> None:
        rank = os.environ.get("LOCAL_RANK", "0")
        (out / f"exit_rank{rank}.txt").write_text(str(torch.distributed.is_initialized()))

    atexit.register(record)


def _count_update_calls() -> list:
    """Record the size of every tensor the optimizer's update function is called with (any backend)."""
    import lightning_pure_bf16.optim.functional as adamw_module  # where the optimizer finds its backends

    calls = []
    for name in ("update_cpu_", "update_torch_"):
        original = getattr(adamw_module, name)

        def counted(param, *args, _original=original, **kwargs):
            calls.append(param.numel())
            return _original(param, *args, **kwargs)

        setattr(adamw_module, name, counted)
    triton_factory = adamw_module._triton_update

    def counted_triton():
        update = triton_factory()

        def counted(param, *args, **kwargs):
            calls.append(param.numel())
            return update(param, *args, **kwargs)

        return counted

    adamw_module._triton_update = counted_triton
    return calls


def _kill_after_first_staged_file() -> None:
    """Simulate a crash in the middle of a save: exit right after the first file of the staged save is written."""

    original = torch.save

    def save(obj, f, *args, **kwargs):
        original(obj, f, *args, **kwargs)
        if ".pure_bf16_tmp" in str(f):
            os._exit(17)

    torch.save = save


if __name__ == "__main__":
    run_all(main, Path(sys.argv[1]), json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
