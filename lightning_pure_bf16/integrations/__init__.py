"""Pure bf16 inside other libraries' training loops, over :mod:`lightning_pure_bf16.deepspeed`.

- :mod:`lightning_pure_bf16.integrations.transformers`: ``PureBF16Trainer``, the Hugging Face ``Trainer`` with
  DeepSpeed ZeRO-3 at 8 bytes/param, and ``pure_bf16_trainer(cls)`` for any subclass of it (TRL's ``SFTTrainer``,
  ``DPOTrainer``);
- :mod:`lightning_pure_bf16.integrations.accelerate`: ``PureBF16Accelerator``, an Accelerate loop likewise.

Each imports its library (the ``hf`` extra: ``pip install 'lightning-pure-bf16[hf]'``) and nothing here imports them.
"""
