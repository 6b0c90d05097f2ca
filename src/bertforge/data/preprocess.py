"""Corpus -> fixed-length token blocks in .npy shards plus a manifest.json, streamed, with worker processes: the
pieces that the `preprocess` stage (tasks/preprocess.py) puts together.

Modes (fairseq's --sample-break-mode, RoBERTa's input formats):
- concat:   documents joined by [SEP] and cut into full blocks; no token is thrown away.
- complete: whole sentences packed into blocks, across documents (FULL-SENTENCES); padded.
- doc:      whole sentences packed into blocks within one document (DOC-SENTENCES); padded.
Every block is [CLS] content [SEP] [PAD]...; a sentence longer than a block is the one thing ever cut. With
`pack` (complete and doc), several blocks share a row instead of padding it, and models attend within each block.

The output is deterministic whatever the number of workers. Shards are written under a temporary name and
renamed, and the stage writes the manifest last: a folder without manifest.json is never taken as finished.
"""

from __future__ import annotations

import collections
import hashlib
import io
import json
import multiprocessing
import os
import resource
import tempfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from bertforge.data.documents import InputFormat, iter_documents, split_sentences
from bertforge.errors import UserError
from bertforge.fileio import write_atomic_fs
from bertforge.tokenizer.load import Tokenizer

MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"  # the shards' own copy of their tokenizer, named in the manifest relative to the folder
FORMAT = "bertforge-shards/1"
CHUNK_DOCS = 512  # documents per unit of work sent to a worker


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
        return [[np.asarray(ids, np.int32)] for ids in tok.tokenize_ids(docs, literal_specials=True)]
    sentences = [split_sentences(d) for d in docs]
    flat = tok.tokenize_ids([s for doc in sentences for s in doc], literal_specials=True)
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
        write_atomic_fs(self.fs, f"{self.root}/{name}", data)
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


def labelled_documents(
    train_files: list[str],
    valid_files: list[str],
    input_format: InputFormat,
    doc_per_line: bool,
    text_field: str,
    seed: int,
    valid_fraction: float,
) -> Iterator[tuple[str, str]]:
    """(split, document) for every document: held-out files go to valid, else a share of the training files."""
    index = 0
    for path in train_files:
        for doc in iter_documents(path, input_format, doc_per_line, text_field):
            split = "valid" if not valid_files and _is_valid_doc(index, seed, valid_fraction) else "train"
            index += 1
            yield split, doc
    for path in valid_files:
        for doc in iter_documents(path, input_format, doc_per_line, text_field):
            yield "valid", doc


def _chunks(docs: Iterator[Any], size: int) -> Iterator[list[Any]]:
    chunk: list[Any] = []
    for doc in docs:
        chunk.append(doc)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def peak_memory_mb() -> float:
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


def write_tokenizer(fs: Any, root: str, tok: Tokenizer) -> None:
    """A copy of the tokenizer inside the shard folder, so the folder works wherever it is moved or copied."""
    fs.makedirs(f"{root}/{TOKENIZER_DIR}", exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save(tmp)
        for file in sorted(Path(tmp).iterdir()):
            write_atomic_fs(fs, f"{root}/{TOKENIZER_DIR}/{file.name}", file.read_bytes())


def tokenize_in_workers(
    docs: Iterator[tuple[str, str]], by_sentence: bool, workers: int, tokenizer_dir: str, tok: Tokenizer
) -> Iterator[tuple[list[tuple[str, str]], list[list[np.ndarray]]]]:
    """(chunk of labelled documents, each document's token arrays) in corpus order, on `workers` processes."""
    fn = _work_by_sentence if by_sentence else _work_whole
    return _ordered_map(fn, _chunks(docs, CHUNK_DOCS), workers, tokenizer_dir, tok)


def _work_whole(chunk: list[tuple[str, str]], tok: Tokenizer | None = None) -> list[list[np.ndarray]]:
    return tokenize_chunk([d for _, d in chunk], False, tok)


def _work_by_sentence(chunk: list[tuple[str, str]], tok: Tokenizer | None = None) -> list[list[np.ndarray]]:
    return tokenize_chunk([d for _, d in chunk], True, tok)
