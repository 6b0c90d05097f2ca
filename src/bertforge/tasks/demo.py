"""`bertforge demo`: the whole pipeline that exists, on a corpus every machine has, in one output folder."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import jax
from flax import nnx

from bertforge import tokenizer
from bertforge.data import preprocess
from bertforge.data.builtin import write_stdlib_corpus
from bertforge.model.hf import load_pretrained
from bertforge.model.presets import preset
from bertforge.tasks import infer, init
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


def main(cfg: DemoConfig) -> dict[str, float]:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def step(name: str) -> None:
        print(f"\n== {name}", flush=True)

    t = time.perf_counter()
    step("corpus: docstrings of the Python standard library")
    docs, size = write_stdlib_corpus(out / "corpus.txt")
    print(f"{docs} documents, {size / 1e6:.1f} MB -> {out / 'corpus.txt'}")
    timings["corpus"] = time.perf_counter() - t

    t = time.perf_counter()
    step(f"tokenizer: WordPiece, {cfg.vocab_size} tokens")
    tok = tokenizer.train([str(out / "corpus.txt")], "wordpiece", cfg.vocab_size, out / "tokenizer", lowercase=True)
    sample = "Return a new dictionary initialized from an optional positional argument."
    pieces = [tok.id_to_token(i) for i in tok.encode(sample).ids]
    print(f"{tok.vocab_size} tokens -> {out / 'tokenizer'}\n{sample!r} ->\n  {' '.join(pieces)}")
    timings["tokenizer"] = time.perf_counter() - t

    t = time.perf_counter()
    step("preprocess: 128-token blocks of whole sentences, 1% of documents held out")
    shards = preprocess.main(
        preprocess.PreprocessConfig(
            tokenizer=str(out / "tokenizer"),
            files=(str(out / "corpus.txt"),),
            out=str(out / "shards"),
            mode="complete",
            doc_per_line=True,
        ),
        progress=False,
    )
    train, valid = shards["splits"]["train"], shards["splits"]["valid"]
    print(
        f"{shards['text_tokens']:,} tokens -> {train['sequences']:,} train + {valid['sequences']:,} valid "
        f"sequences -> {out / 'shards'}"
    )
    timings["preprocess"] = time.perf_counter() - t

    t = time.perf_counter()
    step(f"model: a fresh BERT {cfg.preset}, saved as a Hugging Face folder")
    model_dir = init.main(InitConfig(model=preset(cfg.preset)), str(out / "tokenizer"), str(out / "model-init"))
    pre = load_pretrained(model_dir, head="mlm", require_head=True)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(pre.model, nnx.Param)))
    print(f"{n_params / 1e6:.1f} M parameters -> {model_dir}")
    timings["model"] = time.perf_counter() - t

    t = time.perf_counter()
    step("fill-mask before pretraining (an untrained model guesses at random)")
    for text, masks in zip(PROMPTS, infer.fill_mask(pre, PROMPTS, top_k=3), strict=True):
        guesses = ", ".join(f"{o['token_str']} ({o['score']:.5f})" for o in masks[0])
        print(f"{text}\n  {guesses}")
    timings["fill-mask"] = time.perf_counter() - t

    step("summary")
    print(f"{'stage':<12} {'seconds':>8}")
    for name, seconds in timings.items():
        print(f"{name:<12} {seconds:>8.1f}")
    print(f"everything is in {out.resolve()}")
    return timings
