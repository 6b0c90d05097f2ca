"""Load tokenizers (Hugging Face `tokenizers`) and encode with head, tail or head+tail truncation.

A tokenizer (trained by train.py) is a folder that `transformers.AutoTokenizer.from_pretrained` loads:
tokenizer.json plus tokenizer_config.json naming the special tokens.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

from tokenizers import (
    Tokenizer as HfTokenizer,
)
from tokenizers import (
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from bertforge.errors import UserError
from bertforge.fileio import read_json_object, write_atomic
from bertforge.tokenizer import spm

Truncation = Literal["head", "tail", "head+tail"]
TRUNCATIONS: tuple[str, ...] = get_args(Truncation)
Style = Literal["bert", "roberta"]  # the keys of STYLES


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    cls: str
    sep: str
    pad: str
    mask: str
    unk: str


BERT_SPECIALS = SpecialTokens(cls="[CLS]", sep="[SEP]", pad="[PAD]", mask="[MASK]", unk="[UNK]")
ROBERTA_SPECIALS = SpecialTokens(cls="<s>", sep="</s>", pad="<pad>", mask="<mask>", unk="<unk>")
STYLES = {"bert": BERT_SPECIALS, "roberta": ROBERTA_SPECIALS}


def vocab_order(style: str) -> list[str]:
    # BERT models pad with id 0; RoBERTa's fairseq dictionary order puts <s> at 0 and <pad> at 1.
    s = STYLES[style]
    if style == "roberta":
        return [s.cls, s.pad, s.sep, s.unk, s.mask]
    return [s.pad, s.unk, s.cls, s.sep, s.mask]


def post_processor(tok: HfTokenizer, style: str) -> Any:
    s = STYLES[style]
    cls_id, sep_id = tok.token_to_id(s.cls), tok.token_to_id(s.sep)
    if style == "roberta":
        return processors.TemplateProcessing(
            single=f"{s.cls} $A {s.sep}",
            pair=f"{s.cls} $A {s.sep} {s.sep} $B {s.sep}",
            special_tokens=[(s.cls, cls_id), (s.sep, sep_id)],
        )
    return processors.TemplateProcessing(
        single=f"{s.cls} $A {s.sep}",
        pair=f"{s.cls} $A {s.sep} $B:1 {s.sep}:1",
        special_tokens=[(s.cls, cls_id), (s.sep, sep_id)],
    )


# ----------------------------------------------------------------------------------------------------- encoding
def truncate(ids: Sequence[int], budget: int, strategy: str = "head", head_fraction: float = 0.25) -> list[int]:
    """Cut `ids` to at most `budget` tokens: keep the start (head), the end (tail) or both (head+tail).

    head+tail keeps the first `head_fraction` of the budget and fills the rest from the end, as Sun et al. (2019)
    found best for long documents (128 head + 382 tail tokens of 512).
    """
    ids = list(ids)
    if budget < 0:
        raise ValueError("budget must be >= 0")
    if len(ids) <= budget:
        return ids
    if strategy == "head":
        return ids[:budget]
    if strategy == "tail":
        return ids[len(ids) - budget :]
    if strategy == "head+tail":
        n_head = int(budget * head_fraction)
        n_tail = budget - n_head
        return ids[:n_head] + (ids[len(ids) - n_tail :] if n_tail else [])
    raise UserError(f"unknown truncation '{strategy}' (choose from {', '.join(TRUNCATIONS)})")


def _pair_budgets(la: int, lb: int, budget: int) -> tuple[int, int]:
    """Longest-first split of a token budget between two texts, as `tokenizers` (transformers' fast tokenizers)
    splits it: the shorter text is kept whole if it fits in half; else each gets half, an odd token going to the
    longer text (to the second on a tie)."""
    if la + lb <= budget:
        return la, lb
    short = min(la, lb)
    if short <= budget // 2:
        return (budget - lb, lb) if la > lb else (la, budget - la)
    half = budget // 2
    return (budget - half, half) if la > lb else (half, budget - half)


@dataclasses.dataclass(frozen=True)
class Encoded:
    ids: list[int]
    type_ids: list[int]


@dataclasses.dataclass(frozen=True)
class _Template:
    """Where special tokens go around one text or a pair: prefix A middle B suffix, with their type ids."""

    prefix: list[int]
    middle: list[int]
    suffix: list[int]
    single_suffix: list[int]
    prefix_types: list[int]
    middle_types: list[int]
    suffix_types: list[int]
    b_type: int


def _split_specials(enc: Any) -> list[tuple[list[int], list[int]]]:
    """Runs of special / non-special tokens of an encoding, as (ids, type_ids) groups alternating by kind."""
    groups: list[tuple[bool, list[int], list[int]]] = []
    for tid, typ, special in zip(enc.ids, enc.type_ids, enc.special_tokens_mask, strict=True):
        if groups and groups[-1][0] == bool(special):
            groups[-1][1].append(tid)
            groups[-1][2].append(typ)
        else:
            groups.append((bool(special), [tid], [typ]))
    return groups


class Tokenizer:
    """A `tokenizers.Tokenizer` with its special tokens, encoding with bertforge's truncation strategies."""

    def __init__(
        self,
        tok: HfTokenizer,
        specials: SpecialTokens,
        lowercase: bool | None = None,
        model_max_length: int = 512,
        extra_config: dict[str, Any] | None = None,
    ):
        tok.no_padding()
        tok.no_truncation()
        self.tok = tok
        self.specials = specials
        self.lowercase = lowercase
        self.model_max_length = model_max_length
        self.extra_config = dict(extra_config or {})
        for name in ("cls", "sep", "pad", "mask", "unk"):
            token = getattr(specials, name)
            if tok.token_to_id(token) is None:
                raise UserError(f"the tokenizer has no {name} token '{token}' in its vocabulary")
        self.cls_id = tok.token_to_id(specials.cls)
        self.sep_id = tok.token_to_id(specials.sep)
        self.pad_id = tok.token_to_id(specials.pad)
        self.mask_id = tok.token_to_id(specials.mask)
        self.unk_id = tok.token_to_id(specials.unk)
        self.template = self._template()

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    @property
    def mask_token(self) -> str:
        return self.specials.mask

    def _template(self) -> _Template:
        if self.tok.post_processor is None:  # no template: wrap as BERT does
            return _Template([self.cls_id], [self.sep_id], [self.sep_id], [self.sep_id], [0], [0], [1], 1)
        single = _split_specials(self.tok.encode("a b", add_special_tokens=True))
        pair = _split_specials(self.tok.encode("a b", "c d", add_special_tokens=True))

        def run(groups: list, index: int, special: bool) -> tuple[list[int], list[int]]:
            if 0 <= index < len(groups) and groups[index][0] == special:
                return groups[index][1], groups[index][2]
            return [], []

        start = 1 if pair and pair[0][0] else 0
        prefix, prefix_types = run(pair, 0, True)
        middle, middle_types = run(pair, start + 1, True)
        suffix, suffix_types = run(pair, start + 3, True)
        b_types = pair[start + 2][2] if len(pair) > start + 2 else [0]
        s_start = 1 if single and single[0][0] else 0
        single_suffix, _ = run(single, s_start + 1, True)
        return _Template(prefix, middle, suffix, single_suffix, prefix_types, middle_types, suffix_types, b_types[0])

    def special_ids(self) -> dict[str, Any]:
        """The ids of the named special tokens and of every token registered as special (never masked)."""
        every = sorted(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)
        named = {"cls": self.cls_id, "sep": self.sep_id, "pad": self.pad_id, "mask": self.mask_id, "unk": self.unk_id}
        return {**named, "all": sorted(set(every) | set(named.values()))}

    def word_marks(self) -> dict[str, str]:
        """How this tokenizer marks words, as data.masking.continuation_table takes it: WordPiece's continuation
        prefix, SentencePiece's '▁' or byte-level BPE's 'Ġ' word starts, or nothing (a word-level vocabulary)."""
        data = json.loads(self.tok.to_str())
        model = data.get("model") or {}
        kind = model.get("type")
        if kind == "WordPiece":
            return {"prefix": model.get("continuing_subword_prefix") or "##", "word_start": ""}
        if kind == "WordLevel":
            return {"prefix": "", "word_start": ""}
        return {"prefix": "", "word_start": "Ġ" if "ByteLevel" in json.dumps(data.get("pre_tokenizer")) else "▁"}

    def check_keeps_words(self, docs: Sequence[str], who: str, words_per_doc: int = 200) -> None:
        """For text whose words are separated by spaces: a UserError when this tokenizer would cut a given word
        into several (BERT's normaliser puts every CJK character apart), and a warning when no line has a space."""
        if not any(len(line.split()) > 1 for d in docs for line in d.splitlines()):
            print(f"warning: {who}: no line of the first {len(docs)} documents has a space between words: every "
                  "line is one word", file=sys.stderr)  # fmt: skip
        norm, pre = self.tok.normalizer, self.tok.pre_tokenizer
        for doc in docs:
            for word in doc.split()[:words_per_doc]:
                text = norm.normalize_str(word) if norm else word
                pieces = [p for p, _ in pre.pre_tokenize_str(text)] if pre else [text]
                if len(pieces) > 1:
                    raise UserError(f"{who} cuts the given word {word!r} into {pieces}; train one with "
                                    "--type wordlevel or --type unigram")  # fmt: skip

    def num_special(self, pair: bool = False) -> int:
        t = self.template
        return len(t.prefix) + (len(t.middle) + len(t.suffix) if pair else len(t.single_suffix))

    def tokenize_ids(self, texts: Sequence[str], literal_specials: bool = False) -> list[list[int]]:
        """Token ids without special tokens, in parallel over the batch.

        With `literal_specials` a "[PAD]" or "<mask>" written in the text is read as text: a corpus's words must never
        become a row's structure (a pad id inside a row would be taken for padding).
        """
        before = self.tok.encode_special_tokens
        self.tok.encode_special_tokens = literal_specials
        try:
            return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]
        finally:
            self.tok.encode_special_tokens = before

    def assemble(
        self,
        a: Sequence[int],
        b: Sequence[int] | None = None,
        max_length: int | None = None,
        truncation: str = "head",
        head_fraction: float = 0.25,
    ) -> Encoded:
        """Special tokens around already tokenized text(s), truncated to `max_length` in all."""
        t = self.template
        budget = None if max_length is None else max_length - self.num_special(b is not None)
        if budget is not None and budget < 0:
            raise UserError(f"max_length {max_length} leaves no room for the special tokens")
        if b is None:
            a = truncate(a, budget, truncation, head_fraction) if budget is not None else list(a)
            ids = t.prefix + a + t.single_suffix
            return Encoded(ids, [0] * len(ids))
        if budget is not None:
            ba, bb = _pair_budgets(len(a), len(b), budget)
            a, b = truncate(a, ba, truncation, head_fraction), truncate(b, bb, truncation, head_fraction)
        ids = t.prefix + list(a) + t.middle + list(b) + t.suffix
        types = t.prefix_types + [0] * len(a) + t.middle_types + [t.b_type] * len(b) + t.suffix_types
        return Encoded(ids, types)

    def encode_batch(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        max_length: int | None = None,
        truncation: str = "head",
        head_fraction: float = 0.25,
    ) -> list[Encoded]:
        if truncation not in TRUNCATIONS:
            raise UserError(f"unknown truncation '{truncation}' (choose from {', '.join(TRUNCATIONS)})")
        a_ids = self.tokenize_ids(texts)
        b_ids: Iterable[Any] = self.tokenize_ids(pairs) if pairs is not None else [None] * len(a_ids)
        return [self.assemble(a, b, max_length, truncation, head_fraction) for a, b in zip(a_ids, b_ids, strict=True)]

    def encode(self, text: str, pair: str | None = None, **kwargs: Any) -> Encoded:
        return self.encode_batch([text], None if pair is None else [pair], **kwargs)[0]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    # ------------------------------------------------------------------------------------------------- files
    def config_json(self) -> dict[str, Any]:
        s = self.specials
        cfg: dict[str, Any] = dict(self.extra_config)
        cfg.update(
            tokenizer_class="PreTrainedTokenizerFast",
            cls_token=s.cls,
            sep_token=s.sep,
            pad_token=s.pad,
            mask_token=s.mask,
            unk_token=s.unk,
            model_max_length=self.model_max_length,
        )
        # A loaded tokenizer keeps its model's inputs (ModernBERT's has no token types though its specials are BERT's).
        if s == ROBERTA_SPECIALS:
            cfg.update(bos_token=s.cls, eos_token=s.sep)
            cfg.setdefault("model_input_names", ["input_ids", "attention_mask"])
        else:
            cfg.setdefault("model_input_names", ["input_ids", "token_type_ids", "attention_mask"])
        if self.lowercase is not None:
            cfg["do_lower_case"] = self.lowercase
        return cfg

    def save(self, out: str | Path) -> None:
        """Write tokenizer.json and tokenizer_config.json into folder `out` (each file written whole, then renamed)."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "tokenizer.json", self.tok.to_str(pretty=True))
        write_atomic(out / "tokenizer_config.json", json.dumps(self.config_json(), indent=2) + "\n")

    @classmethod
    def load(cls, folder: str | Path) -> Tokenizer:
        """Load from a folder with tokenizer.json (or a BERT vocab.txt, or DeBERTa's SentencePiece spm.model);
        special tokens from tokenizer_config.json."""
        folder = Path(folder)
        optional = {name: folder / name for name in ("tokenizer_config.json", "special_tokens_map.json")}
        config, special_map = (read_json_object(p) if p.exists() else {} for p in optional.values())
        if (folder / "tokenizer.json").exists():
            try:
                tok = HfTokenizer.from_file(str(folder / "tokenizer.json"))
            except Exception as e:  # tokenizers raises a bare Exception on malformed files
                raise UserError(f"{folder / 'tokenizer.json'}: not a valid tokenizer file ({e})") from None
        elif (folder / "vocab.txt").exists():
            tok = _wordpiece_from_vocab(folder / "vocab.txt", bool(config.get("do_lower_case", True)))
        elif (folder / spm.SPM_FILE).exists():  # DeBERTa-v2/v3: a SentencePiece model, converted as transformers does
            tok = spm.deberta_tokenizer(folder / spm.SPM_FILE, {**special_map, **config})
        else:
            raise UserError(f"{folder}: no tokenizer here (tokenizer.json, vocab.txt or {spm.SPM_FILE})")
        specials = _special_tokens(tok, config, special_map, folder)
        max_len = config.get("model_max_length", 512)
        max_len = max_len if isinstance(max_len, int) and max_len < 10**9 else 512
        keep = {k: v for k, v in config.items() if k in ("clean_up_tokenization_spaces",)}
        names = config.get("model_input_names")
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            keep["model_input_names"] = names
        return cls(tok, specials, config.get("do_lower_case"), max_len, keep)


def _token_str(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(tok: HfTokenizer, config: dict, special_map: dict, folder: Path) -> SpecialTokens:
    found: dict[str, str] = {}
    vocab = tok.get_vocab(with_added_tokens=True)
    for name in ("cls", "sep", "pad", "mask", "unk"):
        token = _token_str(config.get(f"{name}_token")) or _token_str(special_map.get(f"{name}_token"))
        if token is None:  # no config: recognise either convention from the vocabulary
            for style in (BERT_SPECIALS, ROBERTA_SPECIALS):
                if getattr(style, name) in vocab:
                    token = getattr(style, name)
                    break
        if token is None:
            raise UserError(f"{folder}: the tokenizer has no {name} token (set {name}_token in tokenizer_config.json)")
        found[name] = token
    return SpecialTokens(**found)


def _wordpiece_from_vocab(path: Path, lowercase: bool) -> HfTokenizer:
    vocab = {}
    with open(path, encoding="utf-8") as fh:
        for i, line in enumerate(fh):
            vocab[line.rstrip("\n")] = i
    tok = HfTokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([t for t in vocab_order("bert") if t in vocab])
    tok.post_processor = post_processor(tok, "bert")
    return tok
