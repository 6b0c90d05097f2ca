"""`bertforge tokenizer train`: WordPiece, Unigram, byte-level BPE or word-level tokenizers trained on text files.

The Unigram tokenizer is SentencePiece's, trained by the SentencePiece library (spm_train.py), as BPE is on text
mostly without spaces; the others are trained by `tokenizers`. Every type reads its files as a stream, or a
reproducible sample of their lines (corpus.py), and gives the same tokenizer.json for the same files and options.
Unigram keeps spaces as '▁' at the start of a piece and adds one at the start of a text only, so text without spaces
(Japanese, Chinese) is segmented as a whole and decodes without stray spaces. The word-level tokenizer is for text
whose words are already separated by spaces (segmented by MeCab, Sudachi or Jieba, as fairseq's `--tokenizer space`
takes it): every word is a token, the rare ones [UNK].

The result is a folder that `transformers.AutoTokenizer.from_pretrained` and `Tokenizer.load` read.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HfTokenizer

from bertforge.data.documents import expand_files
from bertforge.errors import UserError
from bertforge.fileio import write_atomic
from bertforge.tokenizer.corpus import ReadStats, mostly_cjk, read_lines, reservoir
from bertforge.tokenizer.load import STYLES, Tokenizer, post_processor, vocab_order
from bertforge.tokenizer.spm_train import (
    MAX_PIECE_LENGTH,
    SPM_MODEL_FILE,
    THREADS,
    SpmOptions,
    to_tokenizer,
    train_model,
)

# A vocabulary the text fills less than this share of is an error: the wrong file, or a sample far too small.
MIN_FILL = 0.125

Kind = Literal["wordpiece", "unigram", "bpe", "wordlevel"]
KINDS: tuple[str, ...] = get_args(Kind)


def build_untrained(kind: str, style: str, lowercase: bool) -> tuple[HfTokenizer, Any]:
    """An untrained tokenizers pipeline for `kind` and the trainer that fits it (the kinds `tokenizers` trains)."""
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


@dataclasses.dataclass
class Corpus:
    """The training text: `lines()` streams it again on each call (the sample, when there is one)."""

    paths: list[str]
    sample: list[str] | None
    stats: ReadStats
    progress: bool
    passes: int = 0

    def lines(self) -> Iterable[str]:
        if self.sample is not None:
            return iter(self.sample)
        self.passes += 1  # the first pass counts lines and shows progress; later ones read quietly
        first = self.passes == 1
        return read_lines(self.paths, self.stats if first else ReadStats(), self.progress and first)

    def head(self, n: int = 2000) -> list[str]:
        """The first `n` lines, to tell what script the text is in."""
        lines = iter(self.sample) if self.sample is not None else read_lines(self.paths, ReadStats())
        return list(itertools.islice(lines, n))


def open_corpus(files: Sequence[str], sample_lines: int, seed: int, progress: bool) -> Corpus:
    paths, stats = expand_files(files), ReadStats()
    sample = reservoir(read_lines(paths, stats, progress), sample_lines, seed) if sample_lines else None
    return Corpus(paths, sample, stats, progress)


def train_tokenizer(
    files: Sequence[str],
    kind: str,
    vocab_size: int,
    out: str | Path,
    lowercase: bool = False,
    style: str | None = None,
    min_frequency: int = 2,
    model_max_length: int = 512,
    sample_lines: int = 0,
    seed: int = 0,
    character_coverage: float | None = None,
    max_piece_length: int = MAX_PIECE_LENGTH,
    byte_fallback: bool = False,
    user_symbols: Sequence[str] = (),
    threads: int = THREADS,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a tokenizer on text files and save it as an AutoTokenizer-loadable folder `out`.

    Unigram, and BPE on text mostly without spaces, are trained by SentencePiece (spm_train.py); WordPiece,
    word-level and byte-level BPE by `tokenizers`."""
    style = style or ("roberta" if kind == "bpe" else "bert")
    _check_options(kind, style, vocab_size, sample_lines, character_coverage, max_piece_length, threads)
    spm_options_given = character_coverage is not None or byte_fallback or max_piece_length != MAX_PIECE_LENGTH
    if kind in ("wordpiece", "wordlevel"):  # refused before any reading; BPE once its text's script is known
        _refuse_spm_options(kind, spm_options_given)
    corpus, spm_model, where = open_corpus(files, sample_lines, seed, show_progress), b"", ", ".join(files)
    cjk = kind in ("unigram", "bpe") and mostly_cjk(corpus.head())  # the coverage default and BPE's trainer
    if kind == "unigram" or (kind == "bpe" and cjk):
        if kind == "bpe":
            print("text mostly without spaces: BPE trained by SentencePiece ('▁' word marks, not byte-level)",
                  file=sys.stderr)  # fmt: skip
        coverage = character_coverage if character_coverage is not None else (0.9995 if cjk else 1.0)
        opts = SpmOptions(coverage, max_piece_length, byte_fallback, tuple(user_symbols), threads)
        spm_model = train_model(corpus.lines(), kind, vocab_size, style, lowercase, opts, where)
        tok = to_tokenizer(spm_model, style)
    else:
        _refuse_spm_options(kind, spm_options_given)
        tok = _train_with_tokenizers(corpus, kind, vocab_size, style, lowercase, min_frequency)
        tok.add_tokens([AddedToken(t, normalized=False) for t in user_symbols])
    print(corpus.stats.line(len(corpus.sample) if corpus.sample is not None else None), file=sys.stderr)
    check_filled(tok.get_vocab_size(with_added_tokens=True), vocab_size, where)
    tok.post_processor = post_processor(tok, style)
    result = Tokenizer(tok, STYLES[style], lowercase=lowercase, model_max_length=model_max_length)
    result.save(out)
    # For SentencePiece's own tools (fairseq's --sentencepiece-model); bertforge reads tokenizer.json.
    if spm_model:
        write_atomic(Path(out) / SPM_MODEL_FILE, spm_model)
    else:  # not one left from an earlier training into the same folder
        (Path(out) / SPM_MODEL_FILE).unlink(missing_ok=True)
    return result


def check_filled(size: int, vocab_size: int, where: str) -> None:
    """A warning when the text gives fewer tokens than asked; an error when it gives far fewer (a wrong file)."""
    if size < MIN_FILL * vocab_size:
        raise UserError(
            f"{where}: too little text for --vocab-size {vocab_size}: it gives {size} tokens at most; give more "
            "text (or a larger --sample-lines) or ask for a smaller vocabulary"
        )
    if size < vocab_size:
        print(f"warning: {where}: the text gives {size} tokens, fewer than --vocab-size {vocab_size}", file=sys.stderr)


def _refuse_spm_options(kind: str, given: bool) -> None:
    if given:
        raise UserError(
            "--character-coverage, --byte-fallback and --max-piece-length are SentencePiece's: they apply to "
            f"--type unigram, and to --type bpe on text without spaces, not to --type {kind}"
            + (" on text with spaces" if kind == "bpe" else "")
        )


def _check_options(
    kind: str, style: str, vocab_size: int, sample_lines: int, coverage: float | None, piece: int, threads: int
) -> None:
    if kind not in KINDS:
        raise UserError(f"unknown tokenizer type '{kind}' (choose from {', '.join(KINDS)})")
    if style not in STYLES:
        raise UserError(f"unknown special-token style '{style}' (choose from {', '.join(STYLES)})")
    if vocab_size < 16:
        raise UserError(f"--vocab-size {vocab_size} is too small (at least 16)")
    if sample_lines < 0:
        raise UserError(f"--sample-lines {sample_lines}: a number of lines, or 0 for all of them")
    if coverage is not None and not 0.5 <= coverage <= 1.0:
        raise UserError(f"--character-coverage {coverage}: a share of the characters, from 0.5 to 1")
    if piece < 1 or threads < 1:
        raise UserError("--max-piece-length and --threads must be at least 1")


def _train_with_tokenizers(
    corpus: Corpus, kind: str, vocab_size: int, style: str, lowercase: bool, min_frequency: int
) -> HfTokenizer:
    tok, (trainer_cls, specials, extra) = build_untrained(kind, style, lowercase)
    # The WordPiece trainer numbers its '##' pieces in hash-map order, which breaks ties between equally frequent
    # merges differently from run to run. Handing it those pieces, sorted, as
    # leading special tokens fixes their ids and so every tie; they are plain vocabulary again afterwards.
    pinned = continuation_pieces(corpus.lines(), style, lowercase) if kind == "wordpiece" else []
    trainer = trainer_cls(
        vocab_size=vocab_size,
        special_tokens=specials + [AddedToken(t, special=True) for t in pinned],
        show_progress=corpus.progress,
        min_frequency=min_frequency,
        **extra,
    )
    tok.train_from_iterator(corpus.lines(), trainer=trainer)
    return _drop_added_tokens(tok, set(pinned)) if pinned else tok


def continuation_pieces(lines: Iterable[str], style: str, lowercase: bool) -> list[str]:
    """The '##c' pieces the WordPiece trainer makes of `lines`, sorted: those of every character that follows another
    inside a pre-tokenized word. A trainer asked for no merges gives them (its alphabet) in one parallel pass."""
    tok, (trainer_cls, specials, extra) = build_untrained("wordpiece", style, lowercase)
    trainer = trainer_cls(vocab_size=1, special_tokens=specials, show_progress=False, **extra)
    tok.train_from_iterator(lines, trainer=trainer)
    return sorted(t for t in tok.get_vocab() if t.startswith("##"))  # '#' is punctuation: never inside a word


def _drop_added_tokens(tok: HfTokenizer, names: set[str]) -> HfTokenizer:
    data = json.loads(tok.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] not in names]
    return HfTokenizer.from_str(json.dumps(data))
