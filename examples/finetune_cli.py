"""The fine-tuning example through LightningCLI.

    python examples/finetune_cli.py fit --config examples/finetune.yaml

The model's directory or hub id (``model.pretrained``) is also the data's tokenizer (``data.pretrained``).
"""

from finetune import FineTune, TextBlocks
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

import lightning_pure_bf16  # noqa: F401  (registers "deepspeed_pure_bf16" for the config's trainer.strategy)


class FineTuneCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("model.pretrained", "data.pretrained")


if __name__ == "__main__":
    # The resolved config is saved next to the run; overwrite it so the example can be run again.
    FineTuneCLI(FineTune, TextBlocks, save_config_kwargs={"overwrite": True})
