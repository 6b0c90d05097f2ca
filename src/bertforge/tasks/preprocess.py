"""`bertforge preprocess`: a corpus -> fixed-length token blocks in .npy shards plus a manifest.json.

The pieces (tokenizing workers, packing, shard writing) are in data/preprocess.py; this stage checks the settings,
skips a folder that already holds the same shards, and writes the manifest last, so that a folder without
manifest.json is never taken as finished.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import time
from typing import Any, Literal, get_args

import fsspec
import numpy as np
from tqdm.auto import tqdm

from bertforge.data.documents import InputFormat, expand_files, file_size
from bertforge.data.packing import Packer
from bertforge.data.preprocess import (
    FORMAT,
    MANIFEST,
    TOKENIZER_DIR,
    ShardWriter,
    labelled_documents,
    peak_memory_mb,
    read_manifest,
    tokenize_in_workers,
    tokenizer_fingerprint,
    write_tokenizer,
)
from bertforge.errors import UserError
from bertforge.fileio import write_atomic_fs
from bertforge.tokenizer.load import Tokenizer

Mode = Literal["concat", "complete", "doc"]


@dataclasses.dataclass(frozen=True)
class PreprocessConfig:
    tokenizer: str  # tokenizer folder
    files: tuple[str, ...]  # text, JSONL or Parquet: paths, globs, fsspec URLs
    out: str  # folder or fsspec URL for the shards and manifest.json
    seq_len: int = 128  # tokens per sequence, the special tokens included
    mode: Mode = "concat"  # concat: cut the joined text; complete: whole sentences; doc: sentences of one document
    workers: int = 1  # tokenizer processes
    valid_fraction: float = 0.01  # share of documents held out
    valid_files: tuple[str, ...] = ()  # held-out files instead of a share of the documents
    shard_size: int = 65536  # sequences per shard
    input_format: InputFormat = "auto"  # text, jsonl or parquet; auto: from each file's name
    doc_per_line: bool = False  # text: one document per line, not per blank-line block
    text_field: str = "text"  # JSONL field or Parquet column holding the text
    seed: int = 0  # decides which documents are held out
    pretokenized: bool = False  # words split by spaces (MeCab, Jieba output), which the tokenizer must keep whole
    pack: bool = False  # complete, doc: several blocks to a row, attention within each, instead of padding

    def __post_init__(self) -> None:
        if self.mode not in get_args(Mode):
            raise ValueError(f"mode {self.mode!r} is not one of {', '.join(get_args(Mode))}")
        if self.pack and self.mode == "concat":
            raise ValueError("pack: concat rows are already full; pack rows of mode complete or doc")
        if self.seq_len < 8:
            raise ValueError(f"seq_len must be at least 8, got {self.seq_len}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if not 0.0 <= self.valid_fraction < 1.0:
            raise ValueError(f"valid_fraction must be in [0, 1), got {self.valid_fraction}")
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be at least 1, got {self.shard_size}")
        if not self.files:
            raise ValueError("no input files")


def main(cfg: PreprocessConfig, progress: bool | None = None) -> dict[str, Any]:
    """Preprocess `cfg.files` into shards under `cfg.out`; returns the manifest."""
    tok = _load_tokenizer(cfg)
    train_files = expand_files(cfg.files)
    valid_files = expand_files(cfg.valid_files) if cfg.valid_files else []
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("workers",)}
    settings["files"], settings["valid_files"] = train_files, valid_files
    fingerprint = tokenizer_fingerprint(tok)

    existing = read_manifest(cfg.out)
    if existing is not None:
        if existing.get("settings") == settings and existing.get("tokenizer_sha256") == fingerprint:
            print(f"{cfg.out} already holds these shards (manifest.json); nothing to do", file=sys.stderr)
            return existing
        raise UserError(f"{cfg.out}: already holds shards made with other settings; choose another --out")

    fs, _, (root,) = fsspec.get_fs_token_paths(cfg.out)
    root = root.rstrip("/")
    fs.makedirs(root, exist_ok=True)
    dtype = np.dtype(np.uint16 if tok.vocab_size <= 2**16 else np.int32)
    start, splits, text_tokens = _write_shards(cfg, tok, fs, root, dtype, train_files, valid_files, progress)
    if splits["train"]["sequences"] == 0:
        raise UserError(f"{', '.join(cfg.files)}: no training text (every document went to validation)")
    write_tokenizer(fs, root, tok)
    seconds = time.perf_counter() - start
    manifest = {
        "format": FORMAT,
        "tokenizer": TOKENIZER_DIR,
        "tokenizer_sha256": fingerprint,
        "vocab_size": tok.vocab_size,
        "special_ids": tok.special_ids(),
        "seq_len": cfg.seq_len,
        "mode": cfg.mode,
        "packed": cfg.pack,
        "dtype": dtype.name,
        "splits": splits,
        "text_tokens": text_tokens,
        "settings": settings,
        "stats": {"seconds": round(seconds, 3), "peak_memory_mb": round(peak_memory_mb(), 1)},
    }
    write_atomic_fs(fs, f"{root}/{MANIFEST}", (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    return manifest


def _load_tokenizer(cfg: PreprocessConfig) -> Tokenizer:
    tok = Tokenizer.load(cfg.tokenizer)
    if cfg.seq_len > tok.model_max_length:
        raise UserError(
            f"--seq-len {cfg.seq_len} is longer than the tokenizer's model_max_length {tok.model_max_length} "
            f"({cfg.tokenizer}/tokenizer_config.json)"
        )
    return tok


def _write_shards(
    cfg: PreprocessConfig,
    tok: Tokenizer,
    fs: fsspec.AbstractFileSystem,
    root: str,
    dtype: np.dtype,
    train_files: list[str],
    valid_files: list[str],
    progress: bool | None,
) -> tuple[float, dict[str, dict[str, Any]], int]:
    """Every document tokenized, packed and written to its split's shards; returns the start time, each split's
    manifest entry and the number of text tokens."""
    writers = {split: ShardWriter(fs, root, split, cfg.shard_size, dtype, tok.pad_id) for split in ("train", "valid")}
    packers = {split: Packer(cfg.seq_len, cfg.mode, tok.cls_id, tok.sep_id, tok.pad_id, cfg.pack) for split in writers}
    total_bytes = sum(file_size(f) for f in train_files + valid_files)
    docs = labelled_documents(
        train_files, valid_files, cfg.input_format, cfg.doc_per_line, cfg.text_field, cfg.seed, cfg.valid_fraction
    )
    checked = not cfg.pretokenized
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=total_bytes or None, unit="B", unit_scale=True, desc="preprocess", disable=not show)
    start = time.perf_counter()
    text_tokens = 0
    documents = collections.Counter()
    for chunk, tokenized in tokenize_in_workers(docs, cfg.mode != "concat", cfg.workers, cfg.tokenizer, tok):
        if not checked:
            tok.check_keeps_words([d for _, d in chunk], f"--pretokenized: the tokenizer {cfg.tokenizer}")
            checked = True
        for (split, doc), pieces in zip(chunk, tokenized, strict=True):
            documents[split] += 1
            text_tokens += sum(len(p) for p in pieces)
            writers[split].add(packers[split].add_document(pieces))
            bar.update(len(doc.encode("utf-8")))
        bar.set_postfix(tokens_per_s=f"{text_tokens / max(time.perf_counter() - start, 1e-9):,.0f}")
    bar.close()
    splits = {}
    for split, writer in writers.items():
        writer.add(packers[split].finish())
        splits[split] = writer.close()
        splits[split]["documents"] = documents[split]
        splits[split]["split_sentences"] = packers[split].split_sentences
    return start, splits, text_tokens


def describe(m: dict[str, Any], out: str) -> str:
    """The line `bertforge preprocess` prints of a manifest `m` it wrote to `out`."""
    train, valid, stats = m["splits"]["train"], m["splits"]["valid"], m["stats"]
    rate = m["text_tokens"] / max(stats["seconds"], 1e-9)
    padding = f", {train['padding']:.1%} padding" if "padding" in train else ""  # absent from older shards
    kind = m["mode"] + ", packed" * m.get("packed", False) + padding
    return (
        f"{train['sequences']:,} train sequences in {len(train['shards'])} shard(s), {valid['sequences']:,} valid "
        f"sequences, {m['seq_len']} tokens each ({kind}); {m['text_tokens']:,} text tokens in {stats['seconds']:.1f} s "
        f"({rate:,.0f} tokens/s), peak memory {stats['peak_memory_mb']:.0f} MB -> {out}/manifest.json"
    )
