"""Corpus -> fixed-length token blocks in .npy shards plus a manifest.json, streamed, with worker processes.

Modes (fairseq's --sample-break-mode, RoBERTa's input formats):
- concat:   documents joined by [SEP] and cut into full blocks; no token is thrown away.
- complete: whole sentences packed into blocks, across documents (FULL-SENTENCES); padded.
- doc:      whole sentences packed into blocks within one document (DOC-SENTENCES); padded.
Every block is [CLS] content [SEP] [PAD]...; a sentence longer than a block is the one thing ever cut. With
`pack` (complete and doc), several blocks share a row instead of padding it, and models attend within each block.

The output is deterministic whatever the number of workers. Shards are written under a temporary name and
renamed, and the manifest is written last: a folder without manifest.json is never taken as finished.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, get_args

import fsspec
import numpy as np
from tqdm.auto import tqdm

from bertforge.data.documents import InputFormat, expand_files, file_size, iter_documents, split_sentences
from bertforge.data.packing import Packer
from bertforge.errors import UserError
from bertforge.tokenizer.load import Tokenizer

Mode = Literal["concat", "complete", "doc"]
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"  # the shards' own copy of their tokenizer, named in the manifest relative to the folder
FORMAT = "bertforge-shards/1"
CHUNK_DOCS = 512  # documents per unit of work sent to a worker


@dataclasses.dataclass(frozen=True)
class PreprocessConfig:
    tokenizer: str  # tokenizer folder
    files: tuple[str, ...]  # text, JSONL or Parquet: paths, globs, fsspec URLs
    out: str  # folder or fsspec URL for the shards and manifest.json
    seq_len: int = 128
    mode: Mode = "concat"  # concat: cut the joined text; complete: whole sentences; doc: sentences of one document
    workers: int = 1  # tokenizer processes
    valid_fraction: float = 0.01  # share of documents held out
    valid_files: tuple[str, ...] = ()  # held-out files instead of a share of the documents
    shard_size: int = 65536  # sequences per shard
    input_format: InputFormat = "auto"
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


def tokenizer_fingerprint(tok: Tokenizer) -> str:
    """sha256 of the tokenizer's canonical JSON: equal fingerprints tokenize identically."""
    return hashlib.sha256(tok.tok.to_str().encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------------------------------ workers
_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer_dir: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["RAYON_NUM_THREADS"] = "1"  # one process per core: no thread pool inside each
    _WORKER_TOKENIZER = Tokenizer.load(tokenizer_dir)


def tokenize_chunk(docs: Sequence[str], by_sentence: bool, tok: Tokenizer | None = None) -> list[list[np.ndarray]]:
    """Each document as a list of token-id arrays: one per sentence, or one for the whole document."""
    tok = tok or _WORKER_TOKENIZER
    assert tok is not None
    if not by_sentence:
        return [[np.asarray(ids, np.int32)] for ids in tok.tokenize_ids(docs)]
    sentences = [split_sentences(d) for d in docs]
    flat = tok.tokenize_ids([s for doc in sentences for s in doc])
    out, i = [], 0
    for doc in sentences:
        out.append([np.asarray(ids, np.int32) for ids in flat[i : i + len(doc)] if ids])
        i += len(doc)
    return out


def _ordered_map(fn, chunks: Iterable[Any], workers: int, tokenizer_dir: str, tok: Tokenizer) -> Iterator[Any]:
    """fn over chunks in order, on `workers` processes, with a bounded number of chunks in flight."""
    if workers == 1:
        for chunk in chunks:
            yield chunk, fn(chunk, tok)
        return
    ctx = multiprocessing.get_context("spawn")  # a fork after the tokenizer's thread pool started can deadlock
    with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_dir,)) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            pending.append((chunk, pool.apply_async(fn, (chunk,))))
            if len(pending) >= 2 * workers:
                c, r = pending.popleft()
                yield c, r.get()
        while pending:
            c, r = pending.popleft()
            yield c, r.get()


# ------------------------------------------------------------------------------------------------------ writing
class ShardWriter:
    """Rows -> `<split>-NNNNN.npy` shards of `shard_size` rows, each written whole under a temporary name."""

    def __init__(
        self, fs: fsspec.AbstractFileSystem, root: str, split: str, shard_size: int, dtype: np.dtype, pad_id: int
    ):
        self.fs, self.root, self.split = fs, root, split
        self.shard_size, self.dtype, self.pad_id = shard_size, dtype, pad_id
        self.rows: list[np.ndarray] = []
        self.shards: list[dict[str, Any]] = []
        self.pad_tokens = 0

    def add(self, rows: list[np.ndarray]) -> None:
        self.rows.extend(rows)
        while len(self.rows) >= self.shard_size:
            self._write(self.rows[: self.shard_size])
            self.rows = self.rows[self.shard_size :]

    def _write(self, rows: list[np.ndarray]) -> None:
        array = np.stack(rows).astype(self.dtype)
        buf = io.BytesIO()
        np.save(buf, array, allow_pickle=False)
        data = buf.getvalue()
        name = f"{self.split}-{len(self.shards):05d}.npy"
        path = f"{self.root}/{name}"
        tmp = f"{self.root}/.{name}.tmp"
        with self.fs.open(tmp, "wb") as fh:
            fh.write(data)
        self.fs.mv(tmp, path)
        self.pad_tokens += int(np.sum(array == self.pad_id))
        self.shards.append(
            {
                "path": name,
                "sequences": int(array.shape[0]),
                "tokens": int(array.size),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )

    def close(self) -> dict[str, Any]:
        if self.rows:
            self._write(self.rows)
            self.rows = []
        tokens = sum(s["tokens"] for s in self.shards)
        return {
            "sequences": sum(s["sequences"] for s in self.shards),
            "tokens": tokens,
            "padding": round(self.pad_tokens / max(tokens, 1), 4),  # the share of [PAD] in the rows
            "shards": self.shards,
        }


def _is_valid_doc(index: int, seed: int, fraction: float) -> bool:
    # A stable hash of the document's position: the same split on every run and for any number of workers.
    return fraction > 0 and zlib.crc32(f"{seed}:{index}".encode()) / 2**32 < fraction


def _chunks(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def _peak_memory_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return (own + children) / 1024  # ru_maxrss is in KiB on Linux


def read_manifest(root: str) -> dict[str, Any] | None:
    fs, _, (path,) = fsspec.get_fs_token_paths(root)
    manifest = f"{path.rstrip('/')}/{MANIFEST}"
    if not fs.exists(manifest):
        return None
    with fs.open(manifest, "rb") as fh:
        try:
            data = json.loads(fh.read().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{root}/{MANIFEST}: not valid JSON") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise UserError(f"{root}/{MANIFEST}: not a bertforge shard manifest ({FORMAT})")
    return data


def main(cfg: PreprocessConfig, progress: bool | None = None) -> dict[str, Any]:
    """Preprocess `cfg.files` into shards under `cfg.out`; returns the manifest."""
    tok = Tokenizer.load(cfg.tokenizer)
    if cfg.seq_len > tok.model_max_length:
        raise UserError(
            f"--seq-len {cfg.seq_len} is longer than the tokenizer's model_max_length {tok.model_max_length} "
            f"({cfg.tokenizer}/tokenizer_config.json)"
        )
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
    writers = {split: ShardWriter(fs, root, split, cfg.shard_size, dtype, tok.pad_id) for split in ("train", "valid")}
    packers = {split: Packer(cfg.seq_len, cfg.mode, tok.cls_id, tok.sep_id, tok.pad_id, cfg.pack) for split in writers}
    total_bytes = sum(file_size(f) for f in train_files + valid_files)

    def labelled() -> Iterator[tuple[str, str]]:
        index = 0
        for path in train_files:
            for doc in iter_documents(path, cfg.input_format, cfg.doc_per_line, cfg.text_field):
                split = "valid" if not valid_files and _is_valid_doc(index, cfg.seed, cfg.valid_fraction) else "train"
                index += 1
                yield split, doc
        for path in valid_files:
            for doc in iter_documents(path, cfg.input_format, cfg.doc_per_line, cfg.text_field):
                yield "valid", doc

    def chunks() -> Iterator[list[tuple[str, str]]]:
        yield from _chunks(labelled(), CHUNK_DOCS)

    by_sentence = cfg.mode != "concat"
    checked = not cfg.pretokenized
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=total_bytes or None, unit="B", unit_scale=True, desc="preprocess", disable=not show)
    start = time.perf_counter()
    text_tokens = 0
    documents = collections.Counter()
    fn = _work_by_sentence if by_sentence else _work_whole
    for chunk, tokenized in _ordered_map(fn, chunks(), cfg.workers, cfg.tokenizer, tok):
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
    if splits["train"]["sequences"] == 0:
        raise UserError(f"{', '.join(cfg.files)}: no training text (every document went to validation)")
    _write_tokenizer(fs, root, tok)
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
        "stats": {"seconds": round(seconds, 3), "peak_memory_mb": round(_peak_memory_mb(), 1)},
    }
    tmp = f"{root}/.{MANIFEST}.tmp"
    with fs.open(tmp, "wb") as fh:
        fh.write((json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    fs.mv(tmp, f"{root}/{MANIFEST}")
    return manifest


def _write_tokenizer(fs: Any, root: str, tok: Tokenizer) -> None:
    """A copy of the tokenizer inside the shard folder, so the folder works wherever it is moved or copied."""
    fs.makedirs(f"{root}/{TOKENIZER_DIR}", exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(tmp)
        for file in sorted(Path(tmp).iterdir()):
            path = f"{root}/{TOKENIZER_DIR}/{file.name}"
            with fs.open(f"{path}.tmp", "wb") as fh:
                fh.write(file.read_bytes())
            fs.mv(f"{path}.tmp", path)


def _work_whole(chunk: list[tuple[str, str]], tok: Tokenizer | None = None) -> list[list[np.ndarray]]:
    return tokenize_chunk([d for _, d in chunk], False, tok)


def _work_by_sentence(chunk: list[tuple[str, str]], tok: Tokenizer | None = None) -> list[list[np.ndarray]]:
    return tokenize_chunk([d for _, d in chunk], True, tok)
