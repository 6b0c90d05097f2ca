"""`bertforge demo`: the whole pipeline that exists, on a corpus every machine has, in one output folder.

Docstrings of the installed Python standard library -> a WordPiece tokenizer -> shards -> a BERT pretrained for a
few minutes -> a Hugging Face export, with fill-mask completions before and after.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from bertforge import tokenizer
from bertforge.config import from_dict
from bertforge.data import preprocess
from bertforge.data.builtin import write_stdlib_corpus
from bertforge.model.hf import Pretrained, load_pretrained, save_pretrained
from bertforge.model.presets import preset
from bertforge.tasks import infer, init, pretrain
from bertforge.tasks.export import load_run
from bertforge.tasks.init import InitConfig

PROMPTS = (
    "Return the [MASK] of the list.",
    "Raise a [MASK] if the file does not exist.",
    "The socket is [MASK] when the connection ends.",
)


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    out: str = "demo-output"
    vocab_size: int = 8000
    preset: str = "mini"
    minutes: float = 3.0  # pretraining budget


def _show_fill_mask(pre: Pretrained) -> None:
    for text, masks in zip(PROMPTS, infer.fill_mask(pre, PROMPTS, top_k=3), strict=True):
        guesses = ", ".join(f"{o['token_str']} ({o['score']:.3f})" for o in masks[0])
        print(f"{text}\n  {guesses}")


def main(cfg: DemoConfig) -> dict[str, float]:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def stage(name: str) -> float:
        print(f"\n== {name}", flush=True)
        return time.perf_counter()

    t = stage("corpus: docstrings of the Python standard library")
    docs, size = write_stdlib_corpus(out / "corpus.txt")
    print(f"{docs} documents, {size / 1e6:.1f} MB -> {out / 'corpus.txt'}")
    timings["corpus"] = time.perf_counter() - t

    t = stage(f"tokenizer: WordPiece, {cfg.vocab_size} tokens")
    tok = tokenizer.train([str(out / "corpus.txt")], "wordpiece", cfg.vocab_size, out / "tokenizer", lowercase=True)
    sample = "Return a new dictionary initialized from an optional positional argument."
    pieces = [tok.id_to_token(i) for i in tok.encode(sample).ids]
    print(f"{tok.vocab_size} tokens -> {out / 'tokenizer'}\n{sample!r} ->\n  {' '.join(pieces)}")
    timings["tokenizer"] = time.perf_counter() - t

    t = stage("preprocess: 128-token blocks of whole sentences, 2% of documents held out")
    shards = preprocess.main(
        preprocess.PreprocessConfig(
            tokenizer=str(out / "tokenizer"),
            files=(str(out / "corpus.txt"),),
            out=str(out / "shards"),
            mode="complete",
            doc_per_line=True,
            valid_fraction=0.02,
        ),
        progress=False,
    )
    train, valid = shards["splits"]["train"], shards["splits"]["valid"]
    print(
        f"{shards['text_tokens']:,} tokens -> {train['sequences']:,} train + {valid['sequences']:,} valid "
        f"sequences -> {out / 'shards'}"
    )
    timings["preprocess"] = time.perf_counter() - t

    t = stage(f"fill-mask with a fresh BERT {cfg.preset} (before pretraining: random guesses)")
    fresh = init.main(InitConfig(model=preset(cfg.preset)), str(out / "tokenizer"), str(out / "model-init"))
    _show_fill_mask(load_pretrained(fresh, head="mlm", require_head=True))
    timings["fill-mask before"] = time.perf_counter() - t

    t = stage(f"pretrain: BERT {cfg.preset}, masked LM, {cfg.minutes:g} minutes")
    run_cfg = from_dict(
        pretrain.PretrainConfig,
        {
            "model": {"preset": cfg.preset, "hidden_dropout": 0.0, "attention_dropout": 0.0},
            "data": {"shards": str(out / "shards")},
            "train": {"global_batch": 16, "time_budget_minutes": cfg.minutes},
            "optim": {"lr": 1e-3, "warmup_fraction": 0.06},
            "mlm": {"rate": 0.3},
            "eval": {"every": 100},
            "checkpoint": {"every": 500},
            "log": {"every": 20, "tensorboard": False},
        },
    )
    last = pretrain.main(run_cfg, str(out / "run"))
    nan = float("nan")
    print(
        f"{last['step']} steps, {last['tokens']:,.0f} tokens; validation loss {last.get('valid_loss', nan):.3f} "
        f"(perplexity {last.get('valid_perplexity', nan):.0f}) -> {out / 'run'}"
    )
    timings["pretrain"] = time.perf_counter() - t

    t = stage("export as a Hugging Face folder, then fill-mask after pretraining")
    trained = load_run(out / "run")
    save_pretrained(trained.model, out / "model", trained.tokenizer)
    print(f"-> {out / 'model'} (loads with transformers.AutoModelForMaskedLM)")
    _show_fill_mask(trained)
    timings["export + fill-mask"] = time.perf_counter() - t

    stage("summary")
    print(f"{'stage':<20} {'seconds':>8}")
    for name, seconds in timings.items():
        print(f"{name:<20} {seconds:>8.1f}")
    print(f"everything is in {out.resolve()}")
    return timings
