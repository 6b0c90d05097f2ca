"""`bertforge tokenizer train`: WordPiece, Unigram, byte-level BPE or word-level tokenizers trained on text files.

The Unigram tokenizer is SentencePiece's: spaces are kept as '▁' at the start of a piece and one is added at the
start of a text only, so text without spaces (Japanese, Chinese) is segmented as a whole and decodes without stray
spaces. The word-level tokenizer is for text whose words are already separated by spaces (segmented by MeCab,
Sudachi or Jieba, as fairseq's `--tokenizer space` takes it): every word is a token, the rare ones [UNK].

The result is a folder that `transformers.AutoTokenizer.from_pretrained` and `Tokenizer.load` read.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HfTokenizer

from bertforge.data.documents import expand_files, iter_documents
from bertforge.errors import UserError
from bertforge.tokenizer.load import STYLES, Tokenizer, post_processor, vocab_order

Kind = Literal["wordpiece", "unigram", "bpe", "wordlevel"]
KINDS: tuple[str, ...] = get_args(Kind)


def build_untrained(kind: str, style: str, lowercase: bool) -> tuple[HfTokenizer, Any]:
    """An untrained tokenizers pipeline for `kind` and the trainer that fits it."""
    if kind not in KINDS:
        raise UserError(f"unknown tokenizer type '{kind}' (choose from {', '.join(KINDS)})")
    if style not in STYLES:
        raise UserError(f"unknown special-token style '{style}' (choose from {', '.join(STYLES)})")
    s = STYLES[style]
    # The mask token swallows the space before it, so "a <mask>." tokenizes like "a word." (as RoBERTa does).
    specials = [AddedToken(t, special=True, lstrip=(t == s.mask and style == "roberta")) for t in vocab_order(style)]
    if kind == "wordpiece":
        tok = HfTokenizer(models.WordPiece(unk_token=s.unk, continuing_subword_prefix="##"))
        tok.normalizer = normalizers.BertNormalizer(clean_text=True, lowercase=lowercase, strip_accents=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        trainer = trainers.WordPieceTrainer
        extra: dict[str, Any] = {"continuing_subword_prefix": "##"}
    elif kind == "unigram":
        tok = HfTokenizer(models.Unigram())
        norms = [normalizers.NFKC()] + ([normalizers.Lowercase()] if lowercase else [])
        tok.normalizer = normalizers.Sequence(norms)
        # '▁' before the first word only, not after every special token: "東京は[MASK]の" must not become "▁の".
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.UnigramTrainer
        extra = {"unk_token": s.unk}
    elif kind == "wordlevel":
        tok = HfTokenizer(models.WordLevel(unk_token=s.unk))
        if lowercase:
            tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # the given words, never split further
        trainer = trainers.WordLevelTrainer
        extra = {}
    else:  # byte-level BPE, as GPT-2 and RoBERTa
        tok = HfTokenizer(models.BPE())
        if lowercase:
            tok.normalizer = normalizers.Lowercase()
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer
        extra = {"initial_alphabet": pre_tokenizers.ByteLevel.alphabet()}
    return tok, (trainer, specials, extra)


def train_tokenizer(
    files: Sequence[str],
    kind: str,
    vocab_size: int,
    out: str | Path,
    lowercase: bool = False,
    style: str | None = None,
    min_frequency: int = 2,
    model_max_length: int = 512,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a tokenizer on text files and save it as an AutoTokenizer-loadable folder `out`."""
    style = style or ("roberta" if kind == "bpe" else "bert")
    if vocab_size < 16:
        raise UserError(f"--vocab-size {vocab_size} is too small (at least 16)")
    paths = expand_files(files)
    tok, (trainer_cls, specials, extra) = build_untrained(kind, style, lowercase)

    def lines() -> Iterable[str]:
        return (line for path in paths for line in iter_documents(path, doc_per_line=True))

    # The WordPiece trainer numbers its '##' pieces in hash-map order, which breaks ties between equally frequent
    # merges differently from run to run. Handing it those pieces, sorted, as
    # leading special tokens fixes their ids and so every tie; they are plain vocabulary again afterwards.
    pinned = [f"##{c}" for c in sorted(continuation_chars(tok, lines()))] if kind == "wordpiece" else []
    trainer = trainer_cls(
        vocab_size=vocab_size,
        special_tokens=specials + [AddedToken(t, special=True) for t in pinned],
        show_progress=show_progress,
        **extra,
        **({} if kind == "unigram" else {"min_frequency": min_frequency}),
    )
    tok.train_from_iterator(lines(), trainer=trainer)
    if pinned:
        tok = _drop_added_tokens(tok, set(pinned))
    tok.post_processor = post_processor(tok, style)
    result = Tokenizer(tok, STYLES[style], lowercase=lowercase, model_max_length=model_max_length)
    result.save(out)
    return result


def continuation_chars(tok: HfTokenizer, lines: Iterable[str], chunk_chars: int = 1 << 20) -> set[str]:
    """Characters that follow another inside a pre-tokenized word: the ones the trainer makes '##c' pieces of."""
    found: set[str] = set()
    chunk: list[str] = []
    size = 0

    def scan() -> None:
        # Lines joined by newlines pre-tokenize as they do one by one: a newline always splits words.
        text = tok.normalizer.normalize_str("\n".join(chunk)) if tok.normalizer else "\n".join(chunk)
        for word, _ in tok.pre_tokenizer.pre_tokenize_str(text):
            found.update(word[1:])

    for line in lines:
        chunk.append(line)
        size += len(line)
        if size >= chunk_chars:
            scan()
            chunk, size = [], 0
    if chunk:
        scan()
    return found


def _drop_added_tokens(tok: HfTokenizer, names: set[str]) -> HfTokenizer:
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in names]
    return HfTokenizer.from_str(json.dumps(data))
