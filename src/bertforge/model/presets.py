"""Model sizes by name: Google's BERT miniatures (Turc et al. 2019) and the original BERT sizes."""

from __future__ import annotations

import dataclasses

from bertforge.errors import UserError
from bertforge.model.bert import ModelConfig


def _size(layers: int, hidden: int, heads: int, **extra) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_heads=heads, intermediate_size=4 * hidden, **extra)


PRESETS: dict[str, ModelConfig] = {
    # The test suite's model: small enough to compile in a second on a laptop CPU.
    "test": _size(2, 32, 2, vocab_size=1024, max_position_embeddings=128),
    "tiny": _size(2, 128, 2),
    "mini": _size(4, 256, 4),
    "small": _size(4, 512, 8),
    "medium": _size(8, 512, 8),
    "base": _size(12, 768, 12),
    "large": _size(24, 1024, 16),
}


def preset(name: str, key: str = "preset", **overrides) -> ModelConfig:
    """The named preset with field overrides; an unknown name is a UserError listing the known ones."""
    if not isinstance(name, str) or name not in PRESETS:
        raise UserError(f"unknown preset '{name}' for config key '{key}' (choose from {', '.join(PRESETS)})")
    return dataclasses.replace(PRESETS[name], **overrides)
