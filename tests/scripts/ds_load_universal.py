"""Loads a universal checkpoint (written by lightning_pure_bf16's export) into DeepSpeed's own ZeRO-3 engine, bf16-mixed
with torch AdamW and fp32 masters, with DeepSpeed's ``"checkpoint": {"load_universal": true}``, then saves it again in
DeepSpeed's native layout to OUT/reloaded: one CPU process, gloo, no Lightning.

    python tests/scripts/ds_load_universal.py OUT UNIVERSAL_DIR
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from _models import MLP, param_groups  # noqa: E402

out, universal = Path(sys.argv[1]), Path(sys.argv[2])
deepspeed.init_distributed("gloo", dist_init_required=True)
torch.manual_seed(1)


model = MLP()
config = {
    "train_micro_batch_size_per_gpu": 4,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "checkpoint": {"load_universal": True},
}
optimizer = torch.optim.AdamW(param_groups(model), lr=1e-3)
engine, _, _, _ = deepspeed.initialize(
    args=argparse.Namespace(device_rank=0), model=model, optimizer=optimizer, config=config, dist_init_required=False
)
path, _ = engine.load_checkpoint(str(universal))
assert path is not None, "DeepSpeed did not load the universal checkpoint"
engine.save_checkpoint(str(out / "reloaded"), tag="checkpoint")
