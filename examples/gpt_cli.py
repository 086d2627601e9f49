"""The GPT example through LightningCLI: ``python examples/gpt_cli.py fit --config examples/gpt.yaml``."""

from gpt import GPTModule, StdlibBytes
from lightning.pytorch.cli import LightningCLI

import lightning_pure_bf16  # noqa: F401  (registers "deepspeed_pure_bf16" for the config's trainer.strategy)

if __name__ == "__main__":
    # The resolved config is saved next to the run; overwrite it so the example can be run again.
    LightningCLI(GPTModule, StdlibBytes, save_config_kwargs={"overwrite": True})
