"""`bertforge predict` with a question-answering model: each question's answer from the best span over its context's
windows (the mean of a run's fold models' logits), its character start in the context and its probability among
the n-best; a CSV, or JSONL with the n-best when asked."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import fsspec
import numpy as np

from bertforge.data.question_windows import question_windows
from bertforge.data.questions import Question, read_questions
from bertforge.data.tabular import write_csv
from bertforge.fileio import write_atomic_fs
from bertforge.finetuning.spans import Span, answers_of
from bertforge.model.heads import SpanClassifier
from bertforge.model.hf import Pretrained
from bertforge.tasks.model_outputs import fold_mean_outputs, run_limit
from bertforge.tasks.predict_tokens import json_line

N_BEST = 20  # the spans whose scores a probability is over


def question_answers(
    models: Sequence[Pretrained],
    settings: dict[str, Any],
    questions: Sequence[Question],
    max_length: int | None,
    batch_size: int,
    n_best: int = 1,
) -> list[list[Span]]:
    """Each question's `n_best` answers, best first, each scored by its probability among the 20 best; the run's
    lengths, stride and null threshold (run.json `settings`) where none is given."""
    limit = run_limit(models, settings, max_length)
    rows = question_windows(models[0].tokenizer, questions, limit, int(settings.get("stride", 32)),
                            int(settings.get("max_question_length", 64)))  # fmt: skip
    encs = [w.encoded for w in rows]
    mean = fold_mean_outputs(models, SpanClassifier, "question-answering", encs, batch_size, limit)
    question_of = np.array([w.question for w in rows], np.int64)
    offsets = np.stack([w.offsets for w in rows]) if rows else np.zeros((0, limit, 2), np.int32)
    longest = int(settings.get("max_answer_length", 30))
    contexts = [q.context for q in questions]
    # Each score is a probability among the 20 best spans (run_qa's n-best), however few are asked for.
    found = answers_of(contexts, question_of, mean, offsets, longest, max(n_best, N_BEST),
                       settings.get("null_threshold"))  # fmt: skip
    return [spans[: max(n_best, 1)] for spans in found]


def predict_questions(models: Sequence[Pretrained], settings: dict[str, Any], cfg: Any) -> list[list[Span]]:
    """Write cfg.out (infer.PredictConfig) for the questions in cfg.data; returns each one's n-best answers."""
    questions = read_questions(cfg.data, labelled=False)
    if cfg.stride is not None:  # the windows' overlap, where the run's is not wanted (or a folder has none)
        settings = {**settings, "stride": cfg.stride}
    found = question_answers(models, settings, questions, cfg.max_length, cfg.batch_size, cfg.n_best)
    if cfg.out.lower().endswith((".jsonl", ".json")):
        lines = [json_line(_record(q, spans, cfg.n_best)) for q, spans in zip(questions, found, strict=True)]
        fs, path = fsspec.core.url_to_fs(cfg.out)
        write_atomic_fs(fs, path, "".join(lines).encode("utf-8"))
    else:
        body = [[q.id, s[0].text, s[0].start, f"{s[0].probability:.6g}"] for q, s in zip(questions, found, strict=True)]
        write_csv(cfg.out, ["id", "answer", "start", "score"], body)
    return found


def _record(q: Question, spans: Sequence[Span], n_best: int) -> dict[str, Any]:
    best = spans[0]
    out: dict[str, Any] = {"id": q.id, "answer": best.text, "start": best.start, "score": round(best.probability, 6)}
    if n_best > 1:
        out["n_best"] = [{"answer": s.text, "start": s.start, "score": round(s.probability, 6)} for s in spans]
    return out
