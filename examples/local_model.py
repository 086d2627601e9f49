"""A small Llama-architecture model and a byte-level BPE tokenizer made on this machine, saved as transformers saves
them, for trying ``finetune.py`` where the Hugging Face Hub cannot be reached.

Its weights are transformers' random initialisation, not pretrained ones; it has what a released Llama-family model
has that a test model often lacks: tied input and output embeddings, grouped-query attention, a pad token, and a real
tokenizer (trained here on the Python standard library's source).

    python examples/local_model.py local-llama/                 # about 4M parameters
    python examples/finetune.py --model local-llama/ --lr 1e-3
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import torch

SIZES = {
    # hidden, intermediate, layers, attention heads, key-value heads, vocabulary
    "tiny": (32, 64, 2, 4, 2, 512),
    "small": (256, 768, 4, 8, 2, 4096),
}


def save_local_model(out: str | Path, size: str = "small", seed: int = 0) -> Path:
    """Train the tokenizer, build the model (transformers' own initialisation, seeded) and save both into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    hidden, intermediate, layers, heads, kv_heads, vocab = SIZES[size]
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator((p.read_text(errors="replace") for p in sources), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    out = Path(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the directory to write")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    args = parser.parse_args()
    where = save_local_model(args.out, args.size)
    print(f"saved a {args.size} Llama-architecture model and its tokenizer to {where}")
