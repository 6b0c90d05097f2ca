"""`bertforge init`: a freshly initialised model, sized by a preset or config, saved as a Hugging Face folder."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from bertforge.errors import UserError
from bertforge.model.architectures import build
from bertforge.model.config import ModelConfig, preset
from bertforge.model.hf import save_pretrained
from bertforge.tokenizer.load import Tokenizer


@dataclasses.dataclass(frozen=True)
class InitConfig:
    model: ModelConfig = dataclasses.field(default_factory=lambda: preset("mini"))
    head: Literal["mlm", "sequence", "token"] = "mlm"  # masked LM, one output per text, or one per token
    num_labels: int = 1  # outputs of a sequence or token head
    seed: int = 0  # the initial parameters

    def __post_init__(self) -> None:
        if self.num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {self.num_labels}")


def fit_to_tokenizer(cfg: ModelConfig, tokenizer: Tokenizer, vocab_given: bool) -> ModelConfig:
    """The model's vocabulary and pad id follow the tokenizer unless the config fixed the vocabulary size."""
    if vocab_given and tokenizer.vocab_size > cfg.vocab_size:
        raise UserError(
            f"config key 'model.vocab_size' is {cfg.vocab_size}, smaller than the tokenizer's "
            f"{tokenizer.vocab_size} tokens"
        )
    vocab = cfg.vocab_size if vocab_given else tokenizer.vocab_size
    return dataclasses.replace(cfg, vocab_size=vocab, pad_token_id=tokenizer.pad_id)


def main(cfg: InitConfig, tokenizer_dir: str, out: str, vocab_given: bool = False) -> Path:
    tokenizer = Tokenizer.load(tokenizer_dir)
    model_cfg = fit_to_tokenizer(cfg.model, tokenizer, vocab_given)
    model = build(model_cfg, cfg.head, cfg.num_labels, cfg.seed)
    return save_pretrained(model, out, tokenizer)
