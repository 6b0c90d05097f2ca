"""`bertforge tokenizer train`: a tokenizer trained on text files (see tokenizer/train.py)."""

from __future__ import annotations

import dataclasses

from bertforge.tokenizer.load import Style, Tokenizer
from bertforge.tokenizer.spm_train import MAX_PIECE_LENGTH, THREADS
from bertforge.tokenizer.train import Kind, train_tokenizer


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizerTrainConfig:
    files: tuple[str, ...]  # text files: paths, globs or fsspec URLs
    kind: Kind = "wordpiece"  # the tokenizer's model: wordpiece, unigram, bpe or wordlevel
    vocab_size: int = 30522  # tokens in the vocabulary, the special tokens included
    out: str  # folder to write tokenizer.json and tokenizer_config.json
    lowercase: bool = False  # lowercase (and strip accents from) the text before training and encoding
    style: Style | None = None  # special tokens (default: roberta for bpe)
    min_frequency: int = 2  # a token or merge seen fewer times is left out (WordPiece, BPE, WordLevel)
    model_max_length: int = 512  # model_max_length written for transformers
    sample_lines: int = 0  # train on this many lines drawn from all files (0: every line)
    seed: int = 0  # the sample's seed
    character_coverage: float | None = None  # share of characters kept (default 0.9995 for CJK text, else 1)
    max_piece_length: int = MAX_PIECE_LENGTH  # the longest piece, in characters
    byte_fallback: bool = False  # unknown characters as their UTF-8 bytes instead of [UNK]
    user_symbols: tuple[str, ...] = ()  # strings always kept as one token
    threads: int = THREADS  # SentencePiece's threads; the same count gives the same tokenizer on any machine


def main(cfg: TokenizerTrainConfig, show_progress: bool = False) -> Tokenizer:
    return train_tokenizer(**dataclasses.asdict(cfg), show_progress=show_progress)  # the fields are train's arguments
