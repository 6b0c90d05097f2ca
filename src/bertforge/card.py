"""The model card every export carries: README.md with the Hub's YAML metadata, the training config, the final
metrics and the training curves (curves.png beside it)."""

from __future__ import annotations

import io
import math
import re
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Any

import yaml

from bertforge.finetuning import TASKS
from bertforge.model.architectures import config_to_hf
from bertforge.model.config import ModelConfig

CARD = "README.md"
CURVES = "curves.png"

PIPELINES = {"mlm": "fill-mask", "sequence": "text-classification", "token": "token-classification",
             "span": "question-answering", "choice": "multiple-choice", "rtd": "feature-extraction",
             "embedding": "sentence-similarity"}  # fmt: skip
WHAT = {"mlm": "masked-language model", "sequence": "sequence-classification model",
        "token": "token-classification model", "span": "extractive question-answering model",
        "choice": "multiple-choice model",
        "rtd": "replaced-token detection discriminator (fine-tune it with a task head)",
        "embedding": "sentence-embedding model"}  # fmt: skip
# A discriminator loads as its encoder everywhere; its detection head only in ElectraForPreTraining.
AUTO = {"mlm": "AutoModelForMaskedLM", "sequence": "AutoModelForSequenceClassification",
        "token": "AutoModelForTokenClassification", "span": "AutoModelForQuestionAnswering",
        "choice": "AutoModelForMultipleChoice", "rtd": "AutoModel", "embedding": "AutoModel"}  # fmt: skip
HUB_ID = re.compile(r"[A-Za-z0-9][\w.\-]*/[\w.\-]+")


def _metadata(
    model: ModelConfig, head: str, pipeline: str, metrics: list[str], base_model: str, language: tuple[str, ...],
    datasets: tuple[str, ...], license: str,
) -> dict[str, Any]:  # fmt: skip
    # An embedding model is a sentence-transformers folder: the Hub shows it with that library's widget.
    meta: dict[str, Any] = {"library_name": "sentence-transformers" if head == "embedding" else "transformers"}
    if license:
        meta["license"] = license
    if language:
        meta["language"] = list(language)
    if datasets:
        meta["datasets"] = list(datasets)
    # The Hub takes a base model only as a repository id; a local folder means nothing to it.
    if base_model and HUB_ID.fullmatch(base_model) and not Path(base_model).exists():
        meta["base_model"] = base_model
    meta["pipeline_tag"] = pipeline
    meta["tags"] = ["bertforge", config_to_hf(model, head)["model_type"], pipeline]
    meta["tags"] += ["sentence-transformers"] if head == "embedding" else []
    if metrics:
        meta["metrics"] = metrics
    return meta


def final_metrics(records: list[dict[str, Any]], step: int | None = None) -> dict[str, float]:
    """The last logged value of each metric up to `step` (all steps when None)."""
    found: dict[str, float] = {}
    for r in records:
        if step is not None and r.get("step", 0) > step:
            break
        for k, v in r.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                found[k] = float(v)
    return found


def _table(values: dict[str, float]) -> str:
    shown = ["step", "tokens", "epoch", "loss", *sorted(k for k in values if k.startswith("valid_"))]
    rows = [f"| {k} | {values[k]:.6g} |" for k in shown if k in values and math.isfinite(values[k])]
    return "\n".join(["| metric | value |", "|---|---|", *rows]) if rows else "No metrics were logged."


def _model_kind(head: str, task: str) -> tuple[str, str, str]:
    """The pipeline tag, what the model is and the transformers class that loads it: a fine-tuning task's, else
    its head's."""
    if task:
        found = TASKS[task]
        return found.PIPELINE_TAG, found.DESCRIPTION, found.AUTO_CLASS
    return PIPELINES[head], WHAT[head], AUTO[head]


def _usage(head: str, auto: str, where: str) -> list[str]:
    """The card's lines of Python that load the model."""
    if head == "embedding":
        return ["from sentence_transformers import SentenceTransformer", "",
                f'model = SentenceTransformer("{where}")',
                'vectors = model.encode(["A first text.", "A second one."])']  # fmt: skip
    return [f"from transformers import AutoTokenizer, {auto}", "",
            f'tokenizer = AutoTokenizer.from_pretrained("{where}")',
            f'model = {auto}.from_pretrained("{where}")']  # fmt: skip


def model_card(
    *,
    name: str,
    model: ModelConfig,
    head: str,
    kind: str,
    config: dict[str, Any],
    records: list[dict[str, Any]],
    step: int | None = None,
    metrics: tuple[str, ...] = (),
    base_model: str = "",
    language: tuple[str, ...] = (),
    datasets: tuple[str, ...] = (),
    license: str = "",
    curves: bool = True,
    task: str = "",
) -> str:
    """README.md of an exported model: `name` its Hub repository (ORG/NAME) or folder name, `kind` 'pretrain' or
    'finetune', `records` its metrics.jsonl, `task` the fine-tuning task (finetuning.TASKS) of a fine-tuned one."""
    pipeline, what, auto = _model_kind(head, task)
    meta = _metadata(model, head, pipeline, list(metrics), base_model, language, datasets, license)
    how = "pretrained" if kind == "pretrain" else "fine-tuned"
    model_type = meta["tags"][1]
    where = name if "/" in name else "path/to/this/folder"  # a Hub repository, or wherever it was written
    size = f"{model.num_layers} layers, hidden size {model.hidden_size}, vocabulary {model.vocab_size:,}"
    lines = [
        "---",
        yaml.safe_dump(meta, sort_keys=False, allow_unicode=True).rstrip(),
        "---",
        "",
        f"# {name}",
        "",
        f"A {model_type} {what} ({size}) {how} with bertforge"
        + (f" from {base_model}" if base_model and kind == "finetune" else "")
        + (f", at step {step}" if step is not None else "")
        + ".",
        "",
        "```python",
        *_usage(head, auto, where),
        "```",
        "",
        "## Results",
        "",
        _table(final_metrics(records, step)),
        "",
    ]
    if curves:
        lines += [f"![training curves]({CURVES})", ""]
    lines += [
        "## Training configuration",
        "",
        "```yaml",
        yaml.safe_dump(config, sort_keys=False, allow_unicode=True).rstrip(),
        "```",
        "",
    ]
    return "\n".join(lines)


def curves_png(kind: str, name: str, records: list[dict[str, Any]]) -> bytes:
    """The run's curves as PNG bytes (card_files draws them where a loss was logged)."""
    from bertforge.tasks import plot

    if kind == "pretrain":
        fig = plot.pretrain_figure(name, records)
    else:
        fig = plot.finetune_figure(name, {name: records}, None, [])
    buf = io.BytesIO()
    plot.save_figure(fig, buf, dpi=100, format="png")
    return buf.getvalue()


def card_files(
    *, name: str, kind: str, records: list[dict[str, Any]], pool: Executor | None = None, **card: Any
) -> dict[str, str | bytes | Future]:
    """{README.md: the card, curves.png: the curves} for save_pretrained's extra files. With `pool`, the curves
    are drawn there and come as a Future, so that the caller writes the weights meanwhile (matplotlib's first
    import and the drawing take about as long as writing and syncing a small model's weights)."""
    curves = any("loss" in r for r in records)
    text = model_card(name=name, kind=kind, records=records, curves=curves, **card)
    files: dict[str, str | bytes | Future] = {CARD: text}
    if curves:
        files[CURVES] = pool.submit(curves_png, kind, name, records) if pool else curves_png(kind, name, records)
    return files
