"""SentencePiece model files (DeBERTa-v2/v3's `spm.model`) turned into a `tokenizers` Unigram tokenizer.

An spm.model is a serialised protobuf message (sentencepiece_model.proto). It is read here straight from the
protobuf wire format, only the fields bertforge needs, so no sentencepiece or protobuf runtime is needed and
nothing in the file is ever executed.

The tokenizer built is the one transformers' DebertaV2Tokenizer (transformers 5.25 and later) builds from the same
folder, so that the ids match it and the sentencepiece library's: the model's own precompiled normaliser (its
NFKC charsmap: 'ﬁ' becomes 'fi', fullwidth digits ASCII ones) and runs of spaces folded into one (a model without
a charsmap: whitespace folding and NFC), a Metaspace pre-tokenizer, the model's control pieces as special tokens
(its user-defined pieces are Unigram pieces that the model emits whole, as sentencepiece does), and
[CLS] A [SEP] (B [SEP]) with token type 1 on B.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from bertforge.errors import UserError
from bertforge.fileio import read_json_object

SPM_FILE = "spm.model"
METASPACE = "\u2581"

# SentencePiece.Type and TrainerSpec.ModelType of sentencepiece_model.proto.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
MODEL_TYPES = {1: "Unigram", 2: "BPE", 3: "word", 4: "char"}
UNIGRAM = 1

# DebertaV2Tokenizer's defaults, and the order in which transformers appends named tokens missing from the
# vocabulary (so a missing [MASK] gets the id after the last piece, as deberta-v3's 128000 does).
DEFAULT_NAMES = {
    "bos": "[CLS]",
    "eos": "[SEP]",
    "unk": "[UNK]",
    "sep": "[SEP]",
    "pad": "[PAD]",
    "cls": "[CLS]",
    "mask": "[MASK]",
}


@dataclasses.dataclass(frozen=True)
class Piece:
    piece: str
    score: float
    type: int = NORMAL


@dataclasses.dataclass(frozen=True)
class SpmModel:
    """The fields of a ModelProto that bertforge uses; defaults are the proto's own."""

    pieces: tuple[Piece, ...]
    model_type: int = UNIGRAM
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    byte_fallback: bool = False
    precompiled_charsmap: bytes = b""
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = True


# ---------------------------------------------------------------------------------------------- wire format
class _Malformed(ValueError):
    pass


_FLOAT32 = struct.Struct("<f")


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    if pos < len(buf) and buf[pos] < 0x80:  # one byte: nearly every key and length
        return buf[pos], pos + 1
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise _Malformed("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def _fields(buf: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of one message: ints for varint and fixed-width fields, bytes for length-delimited."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1 or wire == 5:
            width = 8 if wire == 1 else 4
            if pos + width > len(buf):
                raise _Malformed("truncated fixed-width field")
            value, pos = int.from_bytes(buf[pos : pos + width], "little"), pos + width
        elif wire == 2:
            size, pos = _varint(buf, pos)
            if pos + size > len(buf):
                raise _Malformed("truncated length-delimited field")
            value, pos = buf[pos : pos + size], pos + size
        else:  # groups (3, 4) are not used by sentencepiece; 6 and 7 do not exist
            raise _Malformed(f"unexpected wire type {wire}")
        if number == 0:
            raise _Malformed("field number 0")
        yield number, value


def _int32(value: int | bytes) -> int:
    if not isinstance(value, int):
        raise _Malformed("expected an integer")
    value &= 0xFFFFFFFF  # negative int32 are sign-extended to 64 bits on the wire
    return value - (1 << 32) if value >= 1 << 31 else value


def _bytes(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise _Malformed("expected a length-delimited field")
    return value


def _piece(buf: bytes) -> Piece:
    text, score, kind = "", 0.0, NORMAL
    for number, value in _fields(buf):
        if number == 1:
            text = _bytes(value).decode("utf-8")
        elif number == 2:
            if not isinstance(value, int):
                raise _Malformed("piece score is not a float")
            score = _FLOAT32.unpack(value.to_bytes(4, "little"))[0]
        elif number == 3:
            kind = _int32(value)
    return Piece(text, score, kind)


def parse_spm(data: bytes) -> SpmModel:
    """The ModelProto in `data` (raises ValueError when it is not one)."""
    pieces: list[Piece] = []
    spec: dict[str, Any] = {}
    trainer = {3: "model_type", 40: "unk_id", 41: "bos_id", 42: "eos_id", 43: "pad_id", 35: "byte_fallback"}
    normalizer = {3: "add_dummy_prefix", 4: "remove_extra_whitespaces"}
    for number, value in _fields(data):
        if number == 1:
            pieces.append(_piece(_bytes(value)))
        elif number == 2:
            for n, v in _fields(_bytes(value)):
                if n in trainer:
                    spec[trainer[n]] = _int32(v) if trainer[n].endswith(("_id", "_type")) else bool(_int32(v))
        elif number == 3:
            for n, v in _fields(_bytes(value)):
                if n == 2:
                    spec["precompiled_charsmap"] = _bytes(v)
                elif n in normalizer:
                    spec[normalizer[n]] = bool(_int32(v))
    if not pieces:
        raise _Malformed("no pieces")
    return SpmModel(tuple(pieces), **spec)


def read_spm(path: str | Path) -> SpmModel:
    path = Path(path)
    try:
        model = parse_spm(path.read_bytes())
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise UserError(f"{path}: not a SentencePiece model file ({e})") from None
    if model.model_type != UNIGRAM:
        kind = MODEL_TYPES.get(model.model_type, f"type-{model.model_type}")
        raise UserError(f"{path}: a SentencePiece {kind} model; bertforge reads only Unigram ones (DeBERTa-v2/v3)")
    if not 0 <= model.unk_id < len(model.pieces):
        raise UserError(f"{path}: unk_id {model.unk_id} is not a piece of its {len(model.pieces)}")
    return model


# ---------------------------------------------------------------------------------------------- tokenizer
def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _declared_added_tokens(config: dict[str, Any], folder: Path, named: set[str]) -> list[tuple[int, AddedToken]]:
    """Tokens the folder pins to ids: tokenizer_config's added_tokens_decoder, else a legacy added_tokens.json."""
    declared = config.get("added_tokens_decoder")
    found: list[tuple[int, AddedToken]] = []
    if isinstance(declared, dict) and declared:
        for key, entry in declared.items():
            if not (str(key).isdigit() and isinstance(entry, dict) and isinstance(entry.get("content"), str)):
                raise UserError(f"{folder / 'tokenizer_config.json'}: added_tokens_decoder entry {key!r} is malformed")
            flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
            found.append((int(key), AddedToken(entry["content"], **{f: bool(entry[f]) for f in flags if f in entry})))
    elif (folder / "added_tokens.json").exists():
        legacy = read_json_object(folder / "added_tokens.json")
        if not all(isinstance(i, int) for i in legacy.values()):
            raise UserError(f"{folder / 'added_tokens.json'}: expected an object of token: id")
        for text, i in legacy.items():
            special = text in named
            found.append((i, AddedToken(text, normalized=not special, special=special)))
    return sorted(found, key=lambda item: item[0])


def _add(tok: Tokenizer, token: AddedToken) -> None:
    if token.special:
        tok.add_special_tokens([token])
    else:
        tok.add_tokens([token])


def _normalizer(model: SpmModel, lower: bool) -> normalizers.Normalizer:
    """The model's charsmap, then trailing space dropped and runs of spaces folded (the Metaspace pre-tokenizer
    folds a leading one into the word's prefix); without a charsmap, runs of whitespace and any tab or newline
    become one space, then NFC."""
    steps = [normalizers.Lowercase()] if lower else []
    if model.precompiled_charsmap:
        steps += [
            normalizers.Precompiled(model.precompiled_charsmap),
            normalizers.Strip(left=False, right=True),
            normalizers.Replace(Regex(r" {2,}"), " "),
        ]
    else:
        steps += [
            normalizers.Replace(Regex(r"\s{2,}|[\n\r\t]"), " "),
            normalizers.NFC(),
            normalizers.Strip(left=False, right=True),
        ]
    return normalizers.Sequence(steps)


def deberta_tokenizer(path: str | Path, config: dict[str, Any]) -> Tokenizer:
    """The DeBERTa-v2/v3 tokenizer of an spm.model; `config` is tokenizer_config.json over special_tokens_map.json.

    Honours do_lower_case, split_by_punct and add_prefix_space as DebertaV2Tokenizer does.
    """
    path = Path(path)
    model = read_spm(path)
    names = {k: _token_name(config.get(f"{k}_token")) or default for k, default in DEFAULT_NAMES.items()}
    vocab = [(p.piece, p.score) for p in model.pieces]
    # The configured unknown token wins over the model's unk_id when it is a piece (with sentencepiece's 0 score).
    unk_id = next((i for i, v in enumerate(vocab) if v == (names["unk"], 0.0)), model.unk_id)
    tok = Tokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=False))

    tok.normalizer = _normalizer(model, config.get("do_lower_case", False))
    scheme = "always" if config.get("add_prefix_space", True) else "first"
    split = [pre_tokenizers.Punctuation(behavior="isolated")] if config.get("split_by_punct", False) else []
    tok.pre_tokenizer = pre_tokenizers.Sequence([*split, pre_tokenizers.Metaspace(METASPACE, prepend_scheme=scheme)])
    tok.decoder = decoders.Metaspace(METASPACE, prepend_scheme=scheme)

    # Control pieces are special tokens; they are already pieces, so their ids do not move. Then pinned tokens,
    # then named ones the vocabulary lacks, appended. User-defined pieces stay the model's: as added tokens they
    # would split the text around them and drop the space before them, which sentencepiece keeps as a '▁'.
    for p in model.pieces:
        if p.type == CONTROL:
            _add(tok, AddedToken(p.piece, normalized=False, special=True))
    for want, token in _declared_added_tokens(config, path.parent, set(names.values())):
        _add(tok, token)
        if tok.token_to_id(token.content) != want:
            got = tok.token_to_id(token.content)
            raise UserError(f"{path.parent}: added token {token.content!r} is pinned to id {want} but gets id {got}")
    for name in dict.fromkeys(names.values()):
        _add(tok, AddedToken(name, normalized=False, special=True))

    cls, sep = names["cls"], names["sep"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, tok.token_to_id(cls)), (sep, tok.token_to_id(sep))],
    )
    return tok
