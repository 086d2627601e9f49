"""Writes DeepSpeed ZeRO-3 bf16-mixed checkpoints (fp32 master weights, fp32 moments) to OUT/mixed and OUT/mixed_tagged
(DeepSpeed's own tag): one CPU process, gloo, DeepSpeed alone (no Lightning). The model has the parameter names and
shapes of tests/scripts/fit_mlp.py's MLP, so a pure-bf16 run can continue from it."""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from _models import MLP, param_groups  # noqa: E402

out = Path(sys.argv[1])
deepspeed.init_distributed("gloo", dist_init_required=True)
torch.manual_seed(0)


model = MLP()
config = {
    "train_micro_batch_size_per_gpu": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
}
engine, _, _, _ = deepspeed.initialize(
    args=argparse.Namespace(device_rank=0),
    model=model,
    # The param groups of fit_mlp.py's configure_optimizers.
    optimizer=torch.optim.AdamW(param_groups(model), lr=1e-2),
    config=config,
    dist_init_required=False,
)
for _ in range(2):
    loss = engine(torch.randn(4, 16, dtype=torch.bfloat16)).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(str(out / "mixed"), tag="checkpoint")
engine.save_checkpoint(str(out / "mixed_tagged"))  # DeepSpeed's own tag (global_stepN), named in `latest`
