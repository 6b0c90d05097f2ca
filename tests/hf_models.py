"""Small random transformers models saved as Hugging Face folders: the references the tests compare against."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import BertConfig, RobertaConfig

from bertforge.tokenizer.load import Tokenizer

SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def hf_config(family: str, vocab_size: int, **extra):
    # A wide initialiser makes outputs far from uniform, so a wrong weight cannot hide inside tiny logits.
    common = dict(SMALL, vocab_size=vocab_size, initializer_range=0.2, **extra)
    if family == "roberta":
        return RobertaConfig(max_position_embeddings=66, type_vocab_size=1, pad_token_id=1, **common)
    return BertConfig(max_position_embeddings=64, type_vocab_size=2, pad_token_id=0, **common)


def save_hf_model(model_cls, family: str, tokenizer_dir: Path, out: Path, seed: int = 0, **extra) -> Path:
    """A randomly initialised `model_cls` with the tokenizer of `tokenizer_dir`, saved to `out` as safetensors."""
    tok = Tokenizer.load(tokenizer_dir)
    torch.manual_seed(seed)
    model = model_cls(hf_config(family, tok.vocab_size, **extra)).eval()
    # Biases and LayerNorm affine parameters start at 0 / 1; randomise them so the key table is fully exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name or "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    return out
