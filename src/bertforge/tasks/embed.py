"""`bertforge embed`: one vector per text of a table, by an embedding model (a sentence-transformers folder, an
embedding fine-tuning run) or any encoder (its tokens' mean), written as .npy or .parquet."""

from __future__ import annotations

import dataclasses
import io
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from bertforge import runs
from bertforge.data import tabular
from bertforge.errors import UserError
from bertforge.fileio import write_atomic
from bertforge.model.heads import Embedder
from bertforge.model.hf import Pretrained
from bertforge.model.load import load_model
from bertforge.model.sentence_folder import read_pooling
from bertforge.tasks.model_outputs import forward_of, outputs_by_length, packed_forward_of
from bertforge.tasks.packed_batches import inference_shape, packed_outputs, why_not
from bertforge.tokenizer.load import TRUNCATIONS, Truncation

FORMATS = (".npy", ".parquet")


@dataclasses.dataclass(frozen=True)
class EmbedConfig:
    model: str  # a sentence-transformers or Hugging Face folder, hub id, embedding fine-tuning run or pretraining run
    data: str  # a table: CSV, TSV, JSONL or Parquet
    out: str  # .npy ((N, D) float32) or .parquet (the id column, if any, and an 'embedding' column)
    text_column: str = "text"  # the column of texts to embed
    id_column: str | None = None  # kept in a .parquet out; 'id' is kept when present and this is unset
    batch_size: int = 64  # texts per batch
    max_length: int | None = None  # tokens per text (default: the fine-tuning run's, else the model's)
    truncation: Truncation = "head"  # a longer text keeps its start (head), its end (tail) or both (head+tail)
    dtype: str = "float32"  # bfloat16 computes in bfloat16 (vectors are written as float32)
    quoted_tsv: bool = False  # a .tsv table written with CSV quoting; by default a TSV has none and '"' is text
    # By default several texts to a row, in batches of one shape, where the family and pooling allow it;
    # --no-pack: batches of texts of similar length, each padded to its longest.
    pack: bool = True

    def __post_init__(self) -> None:
        if self.truncation not in TRUNCATIONS:
            raise ValueError(f"truncation {self.truncation!r} is not one of {', '.join(TRUNCATIONS)}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {self.batch_size}")
        if not self.out.endswith(FORMATS):
            raise ValueError(f"out {self.out!r}: write .npy or .parquet")


def load_embedder(name: str, dtype: str | None = None) -> tuple[Pretrained, dict]:
    """The embedding model behind `name` and its settings: its fine-tuning run's, or its sentence-transformers
    max_seq_length as max_length, or {}. A run of several folds has as many models, each with its own vector
    space: one of them must be named."""
    found = runs.fold_models(name)
    if found is not None:
        folders, settings = found
        if len(folders) > 1:
            raise UserError(f"{name}: {len(folders)} fold models, each with its own vectors; name one "
                            f"({folders[0]})")  # fmt: skip
        name = str(folders[0])
    else:
        settings = {}
    pre = load_model(name, head="embedding", require_head=True, dtype=dtype)
    if not isinstance(pre.model, Embedder) or pre.tokenizer is None:
        raise UserError(f"{name}: not an embedding model")
    found = read_pooling(pre.folder) if pre.folder.is_dir() else None
    if found is not None and found.max_length and "max_length" not in settings:
        settings = {"max_length": found.max_length}  # where sentence-transformers cuts this model's texts
    return pre, settings


def embed(
    pre: Pretrained,
    texts: Sequence[str],
    batch_size: int = 64,
    max_length: int | None = None,
    truncation: str = "head",
    progress: bool = False,
    packed: bool = True,
) -> np.ndarray:
    """(N, D) float32 vectors of `texts`: packed several to a row in batches of one shape (compiled once) where the
    model's family and pooling have a packed form, else batched by length (each padded length compiled once)."""
    if not isinstance(pre.model, Embedder):
        raise UserError(f"{pre.folder}: not an embedding model")
    cfg = pre.model.config
    limit = min(max_length or cfg.max_seq_len, cfg.max_seq_len)
    encs = pre.tokenizer.encode_batch(list(texts), None, max_length=limit, truncation=truncation)
    pre.model.eval()
    bar = tqdm(total=len(encs), desc="embed", unit="text", disable=not progress, file=sys.stderr)
    try:
        if not encs:
            return np.zeros((0, cfg.hidden_size), np.float32)
        if packed and not why_not("embedding", cfg.family, cfg.pooling):
            shape = inference_shape(np.array([len(e.ids) for e in encs]), batch_size, limit)
            return packed_outputs(packed_forward_of(pre.model), encs, shape, pre.tokenizer.pad_id, bar)
        return outputs_by_length(forward_of(pre.model), encs, pre.tokenizer.pad_id, batch_size, limit, bar=bar)
    finally:
        bar.close()


def main(cfg: EmbedConfig) -> np.ndarray:
    """Write cfg.out; returns the vectors."""
    pre, settings = load_embedder(cfg.model, None if cfg.dtype == "float32" else cfg.dtype)
    columns, rows = tabular.read_table(cfg.data, quoted_tsv=cfg.quoted_tsv)
    if not rows:
        raise UserError(f"{cfg.data}: no rows")
    texts = tabular.text_column(cfg.data, columns, rows, cfg.text_column)
    id_column = cfg.id_column or ("id" if "id" in columns else None)
    ids = tabular.plain_column(cfg.data, columns, rows, id_column) if id_column else None
    max_length = cfg.max_length or settings.get("max_length")
    vectors = embed(pre, texts, cfg.batch_size, max_length, cfg.truncation, progress=True, packed=cfg.pack)
    write(cfg.out, vectors, id_column, ids)
    return vectors


def write(path: str, vectors: np.ndarray, id_column: str | None = None, ids: Sequence[str] | None = None) -> None:
    """(N, D) vectors as .npy, or as .parquet with the ids beside them; whole or not at all."""
    buf = io.BytesIO()
    if path.endswith(".npy"):
        np.save(buf, np.asarray(vectors, np.float32))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        flat = pa.array(np.asarray(vectors, np.float32).reshape(-1))
        column = pa.FixedSizeListArray.from_arrays(flat, vectors.shape[1])
        data = {id_column: pa.array(list(ids))} if id_column and ids is not None else {}
        pq.write_table(pa.table({**data, "embedding": column}), buf)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, buf.getvalue())
