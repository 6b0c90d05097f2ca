"""Fine-tuning with packed rows (data/text_packing.py): whether a run packs, the one shape its batches take, and the
validation outputs of packed batches.

A run packs (`data.pack`) where packing is exact: a sequence, choice or embedding head pooling by cls, mean or max,
or a token or span head, on a family whose encoder attends within each packed text (segment ids; not DeBERTa). By
default (auto) it packs wherever it is exact on an accelerator, and on a CPU only where the packed steps compute at
most MARGIN times what batches padded to the length ladder would (both compute only the first token of each text in
the last layer when the head reads only that). A step's texts go into as many micro-batches of the run's one shape
as they need (train/packed_step.py), so every step of every fold runs the same programs. Where a row is N texts
(WHOLE: an embedding model, whose loss is over the whole batch, and a question's choices, whose scores are
compared), a step's texts go into one batch of as many rows as the fullest step needs (whole_plan); an embedding
model's cached loss (train.grad_accum A > 1) packs each of its A mini-batches of rows on its own. Training batches
are random draws that hold about equal tokens (batching.balanced_batches): with no padding to save, pools sorted by
length buy nothing, and the one shape, sized for the fullest step, wastes least when no step is much fuller than
the mean.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bertforge.data.batching import (
    BUCKET,
    EncodedChoices,
    Row,
    balanced_batches,
    bucket_length,
    epoch_batches,
    padded_length,
    tokens_of,
)
from bertforge.data.text_packing import (
    PackShape,
    eval_batches,
    fill,
    fill_rows,
    first_fit,
    micro_batches,
    pack,
    round_up,
)
from bertforge.model.architectures import SEGMENT_FAMILIES
from bertforge.model.config import ModelConfig
from bertforge.runtime.devices import global_array
from bertforge.train.packed_step import PackedBatch
from bertforge.train.sequence_step import counted

POOLINGS = ("cls", "mean", "max")  # the poolings with a packed form (heads.pool_packed)
# Heads whose rows are N texts (an embedding model's anchor, positive and negatives; a question's choices): a
# step's texts are packed whole into one batch (whole_plan, whole_batch), and evaluation computes each distinct text.
WHOLE = ("embedding", "choice")
# Heads that read every token (entities, answer spans): a packed text's outputs are gathered from its row back to
# (T, L) from its first token (heads.TokenClassifier.packed), so its targets and scores are the padded text's.
TOKEN_HEADS = ("token", "span")
MICRO_COST = 1  # what a micro-batch costs besides its rows (its call, its gradients' addition), in rows
# How much more work packed steps may compute than padded ones and still be chosen: at equal work they ran 9% faster
# on short texts (fewer, larger matrix products; one program to compile; docs/benchmarks.md).
MARGIN = 1.05


def margin(platform: str) -> float:
    """How much more work auto packing may compute than the ladder's padded batches, on `platform` (jax's name).
    On an accelerator a fine-tuning step takes milliseconds and each length compiled takes seconds (CommonLit on an
    H200: about 55 of a first run's 82 s went to the ladder's six lengths and their evaluation programs, in
    docs/gpu.md), so there auto packs wherever packing is exact; on a CPU, where steps are long and compiling
    short, only within MARGIN."""
    return MARGIN if platform == "cpu" else math.inf


def why_not(head: str, family: str, pooling: str) -> str:
    """Why a model cannot be fine-tuned on packed rows ('' when it can)."""
    if head not in ("sequence", *TOKEN_HEADS, *WHOLE):
        return f"the {head} head has no packed form"
    if family not in SEGMENT_FAMILIES:
        return f"{family} has no attention within packed texts"
    if head not in TOKEN_HEADS and pooling not in POOLINGS:
        return f"pooling {pooling} has no packed form"
    return ""


def plan(
    lengths: np.ndarray,
    valid_lengths: np.ndarray,
    fold_rows: Sequence[np.ndarray],
    limit: int,
    settings: dict[str, Any],
    shards: int,
) -> PackShape:
    """The shape of every packed batch of the run: rows of the longest text's length (a multiple of `bucket`);
    micro-batches of the row count that computes the fewest rows over the steps of every fold to run (each
    micro-batch counted a row more, for its call and its addition), never more tokens than a padded micro-batch of
    batch_size / grad_accum texts; and for evaluation about eval_batch_size texts of the mean length a batch.
    `fold_rows`: each fold's training rows; `lengths`: every training row's tokens. `settings`: batch_size,
    grad_accum, epochs, eval_batch_size, seed, bucket, pool (batching.balanced_batches)."""
    s = settings
    length = _row_length(lengths, valid_lengths, limit, s["bucket"])
    needs = _needs(lengths, fold_rows, length, s)
    most = max(1, s["batch_size"] // s["grad_accum"] * limit // length)
    candidates = sorted({round_up(r, shards) for r in range(1, min(int(needs.max()), most) + 1)})
    rows = min(candidates, key=lambda r: (np.ceil(needs / r) * (r + MICRO_COST)).sum())
    per_row = _per_row(lengths, valid_lengths, length)
    texts = round_up(min(s["batch_size"], rows * per_row), shards)
    mean_rows = float((np.ceil(needs / rows) * rows).mean())
    return PackShape(length, rows, texts, *_eval_shape(lengths, valid_lengths, length, s, shards), mean_rows)


def whole_plan(
    lengths: np.ndarray,
    valid_lengths: np.ndarray,
    fold_rows: Sequence[np.ndarray],
    limit: int,
    settings: dict[str, Any],
    shards: int,
) -> PackShape:
    """As plan, for rows of N texts (WHOLE): each step's texts packed into one batch of as many rows as the step
    that needs most; with grad_accum A > 1 (the cached loss), into A mini-batches of as many rows as the fullest
    needs, each of the batch's rows i * A + k in mini-batch k (whole_batch). `lengths` (R, N): the tokens of each
    training row's N texts."""
    s = settings
    a = s["grad_accum"]
    length = _row_length(lengths, valid_lengths, limit, s["bucket"])
    rows = round_up(int(_needs(lengths, fold_rows, length, s, a).max()), shards)
    texts = s["batch_size"] // a * lengths.shape[1]
    return PackShape(length, rows, texts, *_eval_shape(lengths, valid_lengths, length, s, shards), float(rows * a))


def _row_length(lengths: np.ndarray, valid_lengths: np.ndarray, limit: int, bucket: int) -> int:
    """The rows' length: the longest text's, as a multiple of `bucket`."""
    longest = int(max(lengths.max(), valid_lengths.max() if len(valid_lengths) else 0))
    return bucket_length(longest, limit, max(bucket, 1))


def _needs(lengths: np.ndarray, fold_rows: Sequence[np.ndarray], length: int, s: dict[str, Any],
           parts: int = 1) -> np.ndarray:  # fmt: skip
    """The rows each training step of every fold packs its texts into (all texts of a row of (R, N) `lengths`);
    with `parts` A, each of its A mini-batches of rows i * A + k (the step's i-th row in mini-batch i mod A)."""
    return np.array([
        len(first_fit(fold[b[k::parts]].ravel().tolist(), length))
        for fold in (lengths[rows] for rows in fold_rows)
        for epoch in range(math.ceil(s["epochs"]))
        for b in balanced_batches(fold.reshape(len(fold), -1).sum(1), s["batch_size"], s["seed"], epoch, s["pool"])
        for k in range(parts)
    ])  # fmt: skip


def _per_row(lengths: np.ndarray, valid_lengths: np.ndarray, length: int) -> int:
    """The texts a row holds at most."""
    shortest = int(min(lengths.min(), valid_lengths.min() if len(valid_lengths) else length))
    return max(1, length // max(shortest, 1))


def _eval_shape(lengths: np.ndarray, valid_lengths: np.ndarray, length: int, s: dict[str, Any],
                shards: int) -> tuple[int, int]:  # fmt: skip
    """(rows, texts) of an evaluation batch: about eval_batch_size texts of the training texts' mean length."""
    rows = round_up(max(1, math.ceil(s["eval_batch_size"] * float(lengths.mean()) / length)), shards)
    return rows, round_up(rows * _per_row(lengths, valid_lengths, length), shards)


def _first_only(model: ModelConfig, head: str) -> bool:
    """Whether the last layer computes each text's first token only: a head that reads only that (cls pooling)."""
    return model.pooling == "cls" and head not in TOKEN_HEADS


def ladder_work(lengths: np.ndarray, batch_size: int, limit: int, bucket: int, rungs: tuple[int, ...], seed: int,
                model: ModelConfig, per_row: int = 1, head: str = "sequence") -> int:  # fmt: skip
    """Token-layers an epoch of batches padded to the ladder computes: every layer of every padded token, but
    only the first token of each text in the last layer when the head reads only that (cls pooling, not a token
    head). `per_row`: the texts of a row (an embedding model's pair), each padded to the batch's length."""
    first_only = _first_only(model, head)
    texts = batch_size * per_row
    work = 0
    for b in epoch_batches(lengths, batch_size, max(bucket, 1), seed, 0):
        tokens = texts * padded_length(int(lengths[b].max()), limit, bucket, rungs)
        work += tokens * (model.num_layers - first_only) + texts * first_only
    return work


def packed_work(shape: PackShape, rows: int, batch_size: int, model: ModelConfig, per_row: int = 1,
                head: str = "sequence") -> float:  # fmt: skip
    """Token-layers an epoch of packed steps of `rows` rows of data computes: every layer of every token of their
    packed rows, but only each text's first token in the last layer when the head reads only that (as
    ladder_work)."""
    first_only = _first_only(model, head)
    tokens = shape.mean_rows * shape.length
    texts = batch_size * per_row
    return math.ceil(rows / batch_size) * (tokens * (model.num_layers - first_only) + texts * first_only)


def packed_outputs(forward: Callable[[dict[str, np.ndarray]], Any], encs: Sequence[Row], shape: PackShape,
                   pad_id: int, bar: Any = None, limit: int = 0) -> np.ndarray:  # fmt: skip
    """forward(packed batch) -> (N, L) over all encodings, in input order, in batches of shape.eval_rows rows; a
    token model's (N, T, L) as (N, limit, L), zeros past T, as model_outputs.outputs_by_length keeps them. `bar`, a
    tqdm progress bar, advances by the texts done."""
    out: np.ndarray | None = None
    lengths = np.array([tokens_of(e) for e in encs])
    for placed in eval_batches(lengths, shape.length, shape.eval_rows, shape.eval_texts):
        batch, idx = fill_rows(encs, placed, shape.length, shape.eval_rows, shape.eval_texts, pad_id)  # type: ignore[arg-type]
        values = np.asarray(forward(batch))[: len(idx)]
        if out is None:
            out = np.zeros((len(encs), *((limit,) if values.ndim == 3 else ()), values.shape[-1]), np.float32)
        out[idx, : values.shape[1]] = values
        if bar is not None:
            bar.update(len(idx))
    assert out is not None
    return out


def inference_shape(lengths: np.ndarray, batch_size: int, limit: int) -> PackShape:
    """The one shape of packed inference batches over texts of `lengths` tokens: rows of the longest text's length
    (a multiple of BUCKET) holding about batch_size texts of the mean length."""
    length = bucket_length(int(lengths.max()), limit, BUCKET)
    rows = max(1, math.ceil(batch_size * float(lengths.mean()) / length))
    texts = rows * max(1, length // max(int(lengths.min()), 1))
    return PackShape(length, rows, texts, rows, texts)


def step_batch(encs: Sequence[Row], targets: np.ndarray, weights: np.ndarray, shape: PackShape, pad_id: int,
               put: Callable[[np.ndarray], Any], loss: str | None = None) -> PackedBatch:  # fmt: skip
    """A training step's texts, with their targets and weights, as packed micro-batches put on the devices by
    `put`; a step of no texts is one micro-batch of fillers. Its count is what `loss` averages over in the whole
    step (sequence_step.counted: its texts, or for a per-token loss their labelled tokens)."""
    micro = []
    for batch, held in micro_batches(encs, shape, pad_id) or [(fill([], [], shape.length, shape.rows, shape.texts,
                                                                        pad_id), [])]:  # fmt: skip
        t = np.zeros((shape.texts, *targets.shape[1:]), targets.dtype)
        w = np.zeros(shape.texts, np.float32)
        t[: len(held)], w[: len(held)] = targets[held], weights[held]
        micro.append({k: put(v) for k, v in {**batch, "targets": t, "weight": w}.items()})
    return PackedBatch(micro, float(counted(loss, targets, weights)))


def whole_batch(rows: Sequence[EncodedChoices], targets: np.ndarray, weights: np.ndarray, shape: PackShape,
                pad_id: int, size: int, parts: int = 1) -> dict[str, np.ndarray]:  # fmt: skip
    """A training step of `size` rows of N texts each (WHOLE) as one packed batch: text n of row r in slot
    r * N + n; the rows past len(rows) are fillers, with no texts and weight 0. With `parts` A > 1 (the cached
    loss's mini-batches), rows i * A + k go to mini-batch k as its row i, each mini-batch packed on its own, and
    their arrays are interleaved (row j of mini-batch k at j * A + k) as train/step.micro_batches cuts them apart,
    so that each device keeps its own rows of every mini-batch."""
    batches = []
    for k in range(parts):
        encs = [e for row in rows[k::parts] for e in row.options]
        placed = first_fit([len(e.ids) for e in encs], shape.length)
        batches.append(fill(encs, placed, shape.length, shape.rows, shape.texts, pad_id))
    batch = {key: np.stack([b[key] for b in batches], axis=1).reshape(-1, *batches[0][key].shape[1:])
             for key in batches[0]}  # fmt: skip
    t = np.zeros((size, *targets.shape[1:]), targets.dtype)
    w = np.zeros(size, np.float32)
    t[: len(rows)], w[: len(rows)] = targets, weights
    return {**batch, "targets": t, "weight": w}


def job_step_batch(job: Any, rows: np.ndarray) -> PackedBatch | dict[str, Any]:
    """A fine-tuning job's (finetune_fold.Job) training step of `rows` on its devices: packed micro-batches, or for
    rows of N texts one packed batch (whole_batch)."""
    put = functools.partial(global_array, mesh=job.mesh)
    encs, pad_id = [job.encs[i] for i in rows], job.pre.tokenizer.pad_id
    targets, weights = job.table.targets[rows], job.table.weights[rows]
    if job.task.HEAD in WHOLE:
        batch = whole_batch(encs, targets, weights, job.pack, pad_id, job.train.batch_size, job.train.grad_accum)
        return {k: put(v) for k, v in batch.items()}
    return step_batch(encs, targets, weights, job.pack, pad_id, put, loss=job.loss)


def packed_ahead(job: Any, state: Any, key: Any) -> None:
    """Start compiling a packed job's programs (train/ahead.py): its micro-batches' and its evaluation's."""
    job.step_jit.ahead(state, job_step_batch(job, np.zeros(0, np.int64)), key)
    empty = pack([], job.pack.length, job.pack.eval_rows, job.pack.eval_texts, job.pre.tokenizer.pad_id)
    job.forward_jit.ahead(state.params, {k: global_array(v, job.mesh) for k, v in empty.items()})


def shapes_line(shape: PackShape | None, rungs: tuple[int, ...], bucket: int, whole: bool = False) -> str:
    """How a fold's log describes its batches' shapes (`whole`: a step's texts packed into one batch)."""
    if shape is not None and whole:
        parts = round(shape.mean_rows / shape.rows)
        into = "one batch" if parts == 1 else f"{parts} mini-batches"
        return f"each step's texts packed into {into} of {shape.rows} rows of {shape.length} tokens"
    if shape is not None:
        steps = f"{shape.mean_rows / shape.rows:.2f}"
        return f"texts packed into micro-batches of {shape.rows} rows of {shape.length} tokens ({steps} a step)"
    return "texts padded to " + (", ".join(map(str, rungs)) if rungs else f"multiples of {bucket}") + " tokens"


def text_lengths(table: Any, whole: bool) -> np.ndarray:
    """The tokens of each row of `table` (none without one): (R,), or (R, N) for each of a row's N texts."""
    encs = [] if table is None else table.encs or []
    if whole:
        return np.array([[len(o.ids) for o in e.options] for e in encs] or np.zeros((0, 1)), np.int64)
    return np.array([tokens_of(e) for e in encs], np.int64)
