"""`bertforge tokenizer train`: a tokenizer trained on text files (see tokenizer/train.py)."""

from __future__ import annotations

import dataclasses

from bertforge.tokenizer.load import Style, Tokenizer
from bertforge.tokenizer.train import Kind, train_tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerTrainConfig:
    files: tuple[str, ...]  # text files: paths, globs or fsspec URLs
    kind: Kind = "wordpiece"
    vocab_size: int = 30522
    out: str  # folder to write tokenizer.json and tokenizer_config.json
    lowercase: bool = False
    style: Style | None = None  # special tokens (default: roberta for bpe)
    min_frequency: int = 2
    model_max_length: int = 512  # model_max_length written for transformers


def main(cfg: TokenizerTrainConfig, show_progress: bool = False) -> Tokenizer:
    return train_tokenizer(**dataclasses.asdict(cfg), show_progress=show_progress)  # the fields are train's arguments
