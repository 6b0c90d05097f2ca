"""Unigram and BPE tokenizers trained by the SentencePiece library, written as a `tokenizers` pipeline.

SentencePiece's trainer does not pre-split text on spaces, so text without spaces (Japanese, Chinese) costs it
memory in step with the text, not with every substring of every line. The model it trains is turned into the
`tokenizer.json` that transformers' AutoTokenizer loads and that gives SentencePiece's own ids: its normaliser
(the model's precompiled NFKC map, then runs of spaces folded, the end stripped), '▁' for spaces with one added
at the start of a text only, and the pieces with their scores (Unigram) or their merges (BPE).

bertforge's special tokens are SentencePiece's reserved pieces at the ids of its style (BERT's [PAD] 0, [UNK] 1,
[CLS] 2, [SEP] 3, [MASK] 4; RoBERTa's <s> 0, <pad> 1, </s> 2, <unk> 3, <mask> 4), so the ids agree everywhere.
"""

from __future__ import annotations

import dataclasses
import io
import re
from collections.abc import Iterable, Iterator
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HfTokenizer

from bertforge.errors import UserError
from bertforge.tokenizer.load import STYLES, vocab_order
from bertforge.tokenizer.spm import (
    BYTE,
    CONTROL,
    METASPACE,
    UNIGRAM,
    UNKNOWN,
    USER_DEFINED,
    SpmModel,
    parse_spm,
)

# SentencePiece's EM sums over one share of the text per thread, so the thread count changes the scores' last
# digits; a fixed count trains the same tokenizer on every machine.
THREADS = 16
MAX_PIECE_LENGTH = 16  # SentencePiece's own default
# The trained model, written beside tokenizer.json (not spm.model: that name is read as DeBERTa's).
SPM_MODEL_FILE = "sentencepiece.model"


@dataclasses.dataclass(frozen=True)
class SpmOptions:
    character_coverage: float = 1.0
    max_piece_length: int = MAX_PIECE_LENGTH
    byte_fallback: bool = False
    user_symbols: tuple[str, ...] = ()
    threads: int = THREADS


def reserved_ids(style: str) -> dict[str, Any]:
    """SentencePiece's reserved-piece settings that put bertforge's special tokens at their ids: the four
    reserved pieces at 0-3 in the style's order, then the mask token as the first control symbol, id 4."""
    s, order = STYLES[style], vocab_order(style)
    settings: dict[str, Any] = {}
    for name, token in (("pad", s.pad), ("unk", s.unk), ("bos", s.cls), ("eos", s.sep)):
        settings[f"{name}_id"], settings[f"{name}_piece"] = order.index(token), token
    return settings | {"control_symbols": [s.mask]}


def train_model(
    lines: Iterable[str], model_type: str, vocab_size: int, style: str, lowercase: bool, opts: SpmOptions, where: str
) -> bytes:
    """A SentencePiece model (serialised ModelProto) trained on `lines`, from the files `where` names."""
    import sentencepiece

    buf, failed = io.BytesIO(), []

    def guarded() -> Iterator[str]:
        try:
            yield from lines
        except Exception as e:  # raised inside SentencePiece's loop, which would bury it in its own message
            failed.append(e)

    settings = dict(
        sentence_iterator=guarded(),
        model_writer=buf,
        model_type=model_type,
        vocab_size=vocab_size,
        character_coverage=opts.character_coverage,
        max_sentencepiece_length=opts.max_piece_length,
        byte_fallback=opts.byte_fallback,
        user_defined_symbols=list(opts.user_symbols),
        normalization_rule_name="nmt_nfkc_cf" if lowercase else "nmt_nfkc",
        hard_vocab_limit=False,  # a vocabulary the text cannot fill comes out smaller (checked below)
        max_sentence_length=1 << 18,  # bytes; corpus.cut keeps lines under it
        num_threads=opts.threads,
        minloglevel=2,
        **reserved_ids(style),
    )
    try:
        sentencepiece.SentencePieceTrainer.train(**settings)
    except RuntimeError as e:
        if not failed:
            raise UserError(f"{where}: {_trainer_error(str(e), vocab_size, opts)}") from None
    if failed:
        raise failed[0]
    return buf.getvalue()


def _trainer_error(message: str, vocab_size: int, opts: SpmOptions) -> str:
    chars = re.search(r"smaller than required_chars\. (\d+) vs (\d+)", message)
    if chars:
        return (
            f"--vocab-size {vocab_size} is smaller than the {chars.group(2)} characters the text needs at "
            f"--character-coverage {opts.character_coverage}; ask for more, or lower the coverage"
        )
    if "all_chars_count" in message:
        return "no characters left to train on once normalised (control characters are dropped)"
    detail = message.strip().splitlines()[-1].split("] ")[-1].strip() or message.strip()
    return f"SentencePiece could not train: {detail}"


def to_tokenizer(data: bytes, style: str) -> HfTokenizer:
    """The `tokenizers` pipeline that encodes as SentencePiece does with the model `data`."""
    model = parse_spm(data)
    if model.model_type == UNIGRAM:
        vocab = [(p.piece, 0.0 if p.type in (CONTROL, UNKNOWN) else p.score) for p in model.pieces]
        tok = HfTokenizer(models.Unigram(vocab, unk_id=model.unk_id, byte_fallback=model.byte_fallback))
    else:
        tok = HfTokenizer(_bpe(model))
    # SentencePiece's normaliser: the charsmap, then runs of spaces as one and no space at either end (the start's
    # folds into the '▁' that the pre-tokenizer adds).
    tok.normalizer = normalizers.Sequence(
        [
            normalizers.Precompiled(model.precompiled_charsmap),
            normalizers.Strip(left=False, right=True),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    )
    # '▁' before the first word only, not after every special token: "東京は[MASK]の" must not become "▁の".
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="first")
    metaspace = decoders.Metaspace(replacement=METASPACE, prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), metaspace]) if model.byte_fallback else metaspace
    # As XLM-R's, RoBERTa's mask token swallows the space before it.
    mask = STYLES[style].mask if style == "roberta" else None
    specials = [p.piece for p in model.pieces if p.type in (CONTROL, UNKNOWN)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False, lstrip=t == mask) for t in specials])
    symbols = [p.piece for p in model.pieces if p.type == USER_DEFINED]
    tok.add_tokens([AddedToken(t, normalized=False) for t in symbols])
    return tok


def _bpe(model: SpmModel) -> models.BPE:
    """SentencePiece's BPE as merges: every way to join two pieces into a third, the third's id its rank (the
    order in which SentencePiece's encoder prefers them)."""
    vocab = {p.piece: i for i, p in enumerate(model.pieces)}
    merges: list[tuple[int, int, int, str, str]] = []
    for piece, i in vocab.items():
        if model.pieces[i].type in (CONTROL, UNKNOWN, USER_DEFINED, BYTE):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                merges.append((i, vocab[left], vocab[right], left, right))
    merges.sort()
    unk = model.pieces[model.unk_id].piece
    return models.BPE(
        vocab=vocab,
        merges=[(m[3], m[4]) for m in merges],
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=model.byte_fallback,
    )
