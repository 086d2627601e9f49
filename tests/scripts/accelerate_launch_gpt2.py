"""The tiny GPT-2 in an Accelerate loop with ``PureBF16Accelerator``, started by ``accelerate launch --config_file``
with a DeepSpeed config file (the launcher sets the processes and ACCELERATE_USE_DEEPSPEED); each rank writes what it
saw.

    accelerate launch --config_file accelerate.yaml accelerate_launch_gpt2.py OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from hf_gpt2 import dataset, engine_state, tiny_gpt2

from lightning_pure_bf16.integrations.accelerate import PureBF16Accelerator


def main(out: Path) -> None:
    accelerator = PureBF16Accelerator(cpu=True, seed=7)
    model = tiny_gpt2()
    loader = torch.utils.data.DataLoader(dataset(), batch_size=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    losses = []
    for step, batch in enumerate(loader):
        loss = model(**{k: v.to(model.device) for k, v in batch.items()}).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
        if step == 3:
            break
    rank = accelerator.process_index
    result = {"losses": losses, "world": accelerator.num_processes, **engine_state(model, rank)}
    result["zero_stage"] = accelerator.state.deepspeed_plugin.zero_stage
    result["config_bucket"] = accelerator.state.deepspeed_plugin.deepspeed_config["zero_optimization"].get(
        "reduce_bucket_size"
    )
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
