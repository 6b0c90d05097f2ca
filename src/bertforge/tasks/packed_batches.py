"""Fine-tuning with packed rows (data/text_packing.py): whether a run packs, the one shape its batches take, and the
validation outputs of packed batches.

A run packs (`data.pack`) where packing is exact: a sequence head pooling by cls, mean or max, on a family whose
encoder attends within each packed text (segment ids; not DeBERTa). By default (auto) it packs only where the
packed steps compute at most MARGIN times what batches padded to the length ladder would (both compute only the
first token of each text in the last layer when the head reads only that). A step's texts go into as many
micro-batches of the run's one shape as they need (train/packed_step.py), so every step of every fold runs the
same programs. Training batches are then random: with no padding to save, pools sorted by length buy nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from bertforge.data.batching import Row, bucket_length, epoch_batches, padded_length, tokens_of
from bertforge.data.text_packing import PackShape, eval_batches, fill, first_fit, micro_batches, pack, round_up
from bertforge.model.architectures import SEGMENT_FAMILIES
from bertforge.model.config import ModelConfig
from bertforge.runtime.devices import global_array
from bertforge.train.packed_step import PackedBatch

POOLINGS = ("cls", "mean", "max")  # the poolings with a packed form (heads.pool_packed)
MICRO_COST = 1  # what a micro-batch costs besides its rows (its call, its gradients' addition), in rows
# How much more work packed steps may compute than padded ones and still be chosen: at equal work they ran 9% faster
# on short texts (fewer, larger matrix products; one program to compile; docs/benchmarks.md).
MARGIN = 1.05


def why_not(head: str, family: str, pooling: str) -> str:
    """Why a model cannot be fine-tuned on packed rows ('' when it can)."""
    if head != "sequence":
        return f"the {head} head reads tokens, not texts"
    if family not in SEGMENT_FAMILIES:
        return f"{family} has no attention within packed texts"
    if pooling not in POOLINGS:
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
    grad_accum, epochs, eval_batch_size, seed, bucket."""
    s = settings
    longest = int(max(lengths.max(), valid_lengths.max() if len(valid_lengths) else 0))
    length = bucket_length(longest, limit, max(s["bucket"], 1))
    needs = np.array([
        len(first_fit(fold[b].tolist(), length))
        for fold in (lengths[rows] for rows in fold_rows)
        for epoch in range(math.ceil(s["epochs"]))
        for b in epoch_batches(fold, s["batch_size"], 0, s["seed"], epoch)
    ])  # fmt: skip
    most = max(1, s["batch_size"] // s["grad_accum"] * limit // length)
    candidates = sorted({round_up(r, shards) for r in range(1, min(int(needs.max()), most) + 1)})
    rows = min(candidates, key=lambda r: (np.ceil(needs / r) * (r + MICRO_COST)).sum())
    shortest = int(min(lengths.min(), valid_lengths.min() if len(valid_lengths) else length))
    per_row = max(1, length // max(shortest, 1))  # texts a row holds at most
    texts = round_up(min(s["batch_size"], rows * per_row), shards)
    eval_rows = round_up(max(1, math.ceil(s["eval_batch_size"] * float(lengths.mean()) / length)), shards)
    mean_rows = float((np.ceil(needs / rows) * rows).mean())
    return PackShape(length, rows, texts, eval_rows, round_up(eval_rows * per_row, shards), mean_rows)


def ladder_work(lengths: np.ndarray, batch_size: int, limit: int, bucket: int, rungs: tuple[int, ...], seed: int,
                model: ModelConfig) -> int:  # fmt: skip
    """Token-layers an epoch of batches padded to the ladder computes: every layer of every padded token, but
    only the first token of each text in the last layer when the head reads only that (cls pooling)."""
    first_only = model.pooling == "cls"
    work = 0
    for b in epoch_batches(lengths, batch_size, max(bucket, 1), seed, 0):
        tokens = batch_size * padded_length(int(lengths[b].max()), limit, bucket, rungs)
        work += tokens * (model.num_layers - first_only) + batch_size * first_only
    return work


def packed_work(shape: PackShape, texts: int, batch_size: int, model: ModelConfig) -> float:
    """Token-layers an epoch of packed steps computes: every layer of every token of their rows, but only each
    text's first token in the last layer when the head reads only that (cls pooling)."""
    first_only = model.pooling == "cls"
    tokens = shape.mean_rows * shape.length
    return math.ceil(texts / batch_size) * (tokens * (model.num_layers - first_only) + batch_size * first_only)


def packed_outputs(forward: Callable[[dict[str, np.ndarray]], Any], encs: Sequence[Row], shape: PackShape,
                   pad_id: int) -> np.ndarray:  # fmt: skip
    """forward(packed batch) -> (N, L) over all encodings, in input order, in batches of shape.eval_rows rows."""
    out: np.ndarray | None = None
    lengths = np.array([tokens_of(e) for e in encs])
    for idx in eval_batches(lengths, shape.length, shape.eval_rows, shape.eval_texts):
        batch = pack([encs[i] for i in idx], shape.length, shape.eval_rows, shape.eval_texts, pad_id)  # type: ignore[misc]
        values = np.asarray(forward(batch))[: len(idx)]
        if out is None:
            out = np.zeros((len(encs), values.shape[-1]), np.float32)
        out[idx] = values
    assert out is not None
    return out


def step_batch(encs: Sequence[Row], targets: np.ndarray, weights: np.ndarray, shape: PackShape, pad_id: int,
               put: Callable[[np.ndarray], Any]) -> PackedBatch:  # fmt: skip
    """A training step's texts, with their targets and weights, as packed micro-batches put on the devices by
    `put`; a step of no texts is one micro-batch of fillers."""
    micro = []
    for batch, held in micro_batches(encs, shape, pad_id) or [(fill([], [], shape.length, shape.rows, shape.texts,
                                                                        pad_id), [])]:  # fmt: skip
        t = np.zeros((shape.texts, *targets.shape[1:]), targets.dtype)
        w = np.zeros(shape.texts, np.float32)
        t[: len(held)], w[: len(held)] = targets[held], weights[held]
        micro.append({k: put(v) for k, v in {**batch, "targets": t, "weight": w}.items()})
    return PackedBatch(micro, float((weights > 0).sum()))


def job_step_batch(job: Any, rows: np.ndarray) -> PackedBatch:
    """A fine-tuning job's (finetune_fold.Job) training step of `rows` as packed micro-batches on its devices."""
    put = functools.partial(global_array, mesh=job.mesh)
    encs, pad_id = [job.encs[i] for i in rows], job.pre.tokenizer.pad_id
    return step_batch(encs, job.table.targets[rows], job.table.weights[rows], job.pack, pad_id, put)


def packed_ahead(job: Any, state: Any, key: Any) -> None:
    """Start compiling a packed job's programs (train/ahead.py): its micro-batches' and its evaluation's."""
    job.step_jit.ahead(state, job_step_batch(job, np.zeros(0, np.int64)), key)
    empty = pack([], job.pack.length, job.pack.eval_rows, job.pack.eval_texts, job.pre.tokenizer.pad_id)
    job.forward_jit.ahead(state.params, {k: global_array(v, job.mesh) for k, v in empty.items()})


def shapes_line(shape: PackShape | None, rungs: tuple[int, ...], bucket: int) -> str:
    """How a fold's log describes its batches' shapes."""
    if shape is not None:
        steps = f"{shape.mean_rows / shape.rows:.2f}"
        return f"texts packed into micro-batches of {shape.rows} rows of {shape.length} tokens ({steps} a step)"
    return "texts padded to " + (", ".join(map(str, rungs)) if rungs else f"multiples of {bucket}") + " tokens"
