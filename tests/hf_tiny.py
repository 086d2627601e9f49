"""Tiny random-weight models of the Hugging Face families users fine-tune, saved as transformers saves them: each
keeps what sets its family apart (a pad token, tied embeddings, grouped-query attention, biases, Conv1D layers, a
scaled embedding) at a size that trains in seconds on a CPU."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = {"vocab_size": 128, "max_position_embeddings": 64}
DECODER = {
    **SMALL,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def family_configs() -> dict[str, object]:
    import transformers as tf

    return {
        # A pad token (its embedding row zeroed by transformers' init), tied embeddings, grouped-query attention.
        "llama": tf.LlamaConfig(**DECODER, pad_token_id=2, tie_word_embeddings=True),
        # Biases on the query, key and value projections.
        "qwen2": tf.Qwen2Config(**DECODER, tie_word_embeddings=True),
        # Sliding-window attention, an untied head.
        "mistral": tf.MistralConfig(**DECODER, sliding_window=8, tie_word_embeddings=False),
        # Conv1D layers (weights stored transposed), learned positions, LayerNorm biases, tied head.
        "gpt2": tf.GPT2Config(
            vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=1
        ),
        # An embedding scaled by sqrt(hidden_size), RMSNorm as (1 + weight), one key-value head, head_dim apart.
        "gemma": tf.GemmaConfig(**{**DECODER, "num_key_value_heads": 1}, head_dim=8, pad_token_id=0),
    }


def save_families(where: str | Path, max_shard_size: str = "20KB") -> dict[str, str]:
    """Each family built by transformers (its own initialisation, seeded), in bf16, saved by ``save_pretrained`` in
    the sharded layout; the directories by family."""
    import transformers as tf

    out = {}
    for family, config in family_configs().items():
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        with torch.no_grad():  # weights far from their init, so that a wrong tie or a skipped tensor shows
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        directory = Path(where) / family
        model.save_pretrained(directory, max_shard_size=max_shard_size)
        out[family] = str(directory)
    return out
