"""How fast a fine-tuning run can be on this CPU in float32: the least arithmetic an exact run of a task must do,
against the fastest float32 matrix products this machine runs, measured in the same process.

For a task and a results file of the end-to-end benchmarks (finetune_end_to_end.py's CommonLit and short sentences,
or embedding_models.py's JSQuAD retrieval), it counts the model FLOPs that any exact run of the same training must
compute at the least: every text's own tokens, no padding, attention within each text; where the head reads only the
first token (CommonLit's regression, the sentences' classes), the last layer's other positions only as keys and
values; the evaluations' forwards (training counts 3x a forward: the forward, and the backward's two products per
product). Dividing them by a time (a system's measured wall time, or a target ratio of the baseline's: 0.5x its
wall, all of it given to arithmetic, none to start-up, compilation or saves) gives the rate of useful arithmetic
that time means. Beside it, measured in the same process: the rate of a typical step's products if each ran at the
faster of XLA's and PyTorch's best rates for its shape (the attention's: its batched products, or PyTorch's fused
kernel if faster), and the fastest float32 square products (1024 to 4096). A run also spends time on norms, softmax,
activations, the optimizer, start-up and compilation, so a needed rate above the products' cannot be reached on this
machine in float32 by any implementation whose products run no faster than the faster of the two libraries.
Also shown: the baseline's arithmetic at its own padding (random batches padded to their longest text, every
position of every layer; the mean over 20 shuffles), which is what its steps compute.
With `--metrics` (a bertforge run's metrics.jsonl), its training step is set beside that ceiling: the median of its
logged windows' step times after the first (which holds the compilation) against the time the same step's products
take at the faster library's rates, at the rows and length bertforge's log says it packs a step into.

    .venv/bin/python benchmarks/investigations/compute_bound.py --task commonlit --data data/commonlit/train.csv \
        --folds runs/bench-finetune/commonlit/bertforge-hf-256-seed0/folds.csv \
        --results benchmarks/results/finetune_commonlit_hf_cold_zen4_1206.json
    .venv/bin/python benchmarks/investigations/compute_bound.py --task jsquad \
        --data data/jglue/jsquad-v1.3/valid-v1.3.json \
        --results benchmarks/results/jsquad_retrieval_128_frac0.5_zen4_1206.json
    .venv/bin/python benchmarks/investigations/compute_bound.py --task sentences \
        --data runs/bench-finetune/sentences/defaults/train.csv \
        --valid-data runs/bench-finetune/sentences/defaults/valid.csv --rows 5 --length 64 \
        --results benchmarks/results/finetune_sentences_hf_64_cold_defaults_zen3_1207.json \
        --metrics RUN/fold-0/metrics.jsonl   # a `bertforge finetune` run of the same table
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared modules

from finetune_end_to_end import _minilm, cpu_model  # noqa: E402

from bertforge.model.architectures import config_from_hf  # noqa: E402
from bertforge.model.config import ModelConfig  # noqa: E402
from bertforge.train.flops import train_flops_per_token  # noqa: E402

SHUFFLES = 20


def macs(cfg: ModelConfig, length: int, first_only: bool = False) -> float:
    """Multiply-adds of one text's forward at `length` tokens, from bertforge's count of training FLOPs (6 per
    multiply-add of the forward); `first_only`: the last layer's other positions only as keys and values (a head
    that reads the first token), without their queries, outputs, MLP and attention."""
    full = length * train_flops_per_token(cfg, length, predicted_fraction=0.0) / 6
    if not first_only:
        return full
    d, f = cfg.hidden_size, cfg.intermediate_size
    return full - (length - 1) * (2 * d * d + 2 * d * f + 2 * length * d)


@dataclass(frozen=True)
class Work:
    """A run's texts: each training example's texts' lengths (one epoch, in the data's order), the evaluation's
    texts' lengths, and how the run uses them."""

    train: list[list[int]]  # per example: its texts' lengths (one text, or a question and its passage)
    valid: list[int]
    epochs: int
    batch: int
    evaluations: int  # during the run
    baseline_evaluations: int  # the baseline's: the Trainer evaluates the best checkpoint once more at the end
    first_only: bool


@functools.cache
def _tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(_minilm()) / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def _lengths(texts: list[str], max_length: int) -> list[int]:
    return [min(len(e.ids), max_length) for e in _tokenizer().encode_batch(texts)]


def commonlit_work(data: str, folds: str, max_length: int) -> Work:
    """CommonLit fold 0 as finetune_end_to_end.py runs it: 3 epochs of batches of 16, two evaluations an epoch."""
    with open(data, newline="", encoding="utf-8") as fh:
        texts = [r["excerpt"] for r in csv.DictReader(fh)]
    with open(folds, newline="", encoding="utf-8") as fh:
        fold = [int(r["fold"]) for r in csv.DictReader(fh)]
    lengths = _lengths(texts, max_length)
    train = [[n] for n, f in zip(lengths, fold, strict=True) if f != 0]
    valid = [n for n, f in zip(lengths, fold, strict=True) if f == 0]
    return Work(train, valid, epochs=3, batch=16, evaluations=6, baseline_evaluations=7, first_only=True)


def jsquad_work(data: str, max_length: int, fraction: float) -> Work:
    """embedding_models.py's JSQuAD pairs: 1 epoch of batches of 32 (question, passage) pairs, one evaluation of
    each evaluation question and each evaluation passage."""
    from embedding_models import read_csv, split_pairs

    with tempfile.TemporaryDirectory() as tmp:
        split_pairs(Path(data), Path(tmp), fraction)
        train, valid = read_csv(Path(tmp) / "train.csv"), read_csv(Path(tmp) / "valid.csv")
    questions = _lengths([r["question"] for r in train], max_length)
    passages = _lengths([r["passage"] for r in train], max_length)
    valid_texts = list(dict.fromkeys([r["question"] for r in valid] + [r["passage"] for r in valid]))
    pairs = [list(p) for p in zip(questions, passages, strict=True)]
    # Longest first, the order in which sentence-transformers encodes them.
    valid_lengths = sorted(_lengths(valid_texts, max_length), reverse=True)
    return Work(pairs, valid_lengths, epochs=1, batch=32, evaluations=1, baseline_evaluations=1, first_only=False)


def sentences_work(data: str, valid: str, max_length: int) -> Work:
    """finetune_end_to_end.py's short sentences with --recipe defaults: 1 epoch of batches of 16 over its training
    table, one evaluation of its validation table; a head that reads the first token."""

    def texts(path: str) -> list[str]:
        with open(path, newline="", encoding="utf-8") as fh:
            return [r["text"] for r in csv.DictReader(fh)]

    train = [[n] for n in _lengths(texts(data), max_length)]
    return Work(train, _lengths(texts(valid), max_length), epochs=1, batch=16, evaluations=1, baseline_evaluations=1,
                first_only=True)  # fmt: skip


def logged_step_s(metrics: str) -> float:
    """The median step time of a bertforge run's logged windows, the first (its compilation) left out."""
    windows = [json.loads(line) for line in Path(metrics).read_text().splitlines()]
    times = [w["step_time"] for w in windows if "step_time" in w][1:]
    if not times:
        raise SystemExit(f"{metrics}: no logged step times after the first window")
    return statistics.median(times)


def step_flops(cfg: ModelConfig, rows: int, length: int) -> float:
    """The FLOPs of a training step's products on `rows` x `length` tokens (step_products)."""
    return sum(2.0 * c * b * m * k * n for c, b, m, k, n in step_products(cfg, rows, length))


def least_flops(work: Work, cfg: ModelConfig) -> dict[str, float]:
    """The FLOPs of an exact run with no padding: training (3 forwards' worth) and evaluation."""
    train = 6 * work.epochs * sum(macs(cfg, n, work.first_only) for texts in work.train for n in texts)
    valid = 2 * work.evaluations * sum(macs(cfg, n, work.first_only) for n in work.valid)
    return {"train": train, "valid": valid, "total": train + valid}


def padded_flops(work: Work, cfg: ModelConfig, evaluations: int, eval_batch: int = 64) -> float:
    """The FLOPs of a run whose random batches are padded to their longest text (each column of a pair to its
    own) and that computes every position in every layer: the mean over shuffles; its evaluations in batches of
    `eval_batch` in the order of `work.valid`."""
    rng, per_shuffle = np.random.default_rng(0), []
    lengths = np.array(work.train)  # (examples, texts)
    for _ in range(SHUFFLES):
        total = 0.0
        order = rng.permutation(len(lengths))
        for start in range(0, len(order), work.batch):
            rows = lengths[order[start : start + work.batch]]
            total += sum(len(rows) * macs(cfg, int(col.max())) for col in rows.T)
        per_shuffle.append(total)
    train = 6 * work.epochs * statistics.mean(per_shuffle)
    valid = sum(
        len(work.valid[i : i + eval_batch]) * macs(cfg, max(work.valid[i : i + eval_batch]))
        for i in range(0, len(work.valid), eval_batch)
    )
    return train + 2 * evaluations * valid


def _timer(reps: int = 10):
    """rate(run, flops): GFLOP/s of `run()`, its fastest of `reps` calls after two warm-ups: a ceiling, so the
    best the machine gave, not a typical call."""

    def rate(run, flops: float) -> float:
        run(), run()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
        return flops / min(times) / 1e9

    return rate


# How a product's operands may be stored: as multiplied, the second transposed ((batch, n, k): a linear layer's
# weight in PyTorch, the keys in q @ k^T), the first transposed ((batch, k, m): x^T @ g, p^T @ dO).
LAYOUTS = {"ab": "bmk,bkn->bmn", "abT": "bmk,bnk->bmn", "aTb": "bkm,bkn->bmn"}


def _operands(b: int, m: int, k: int, n: int, layout: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    first = (b, k, m) if layout == "aTb" else (b, m, k)
    return first, (b, n, k) if layout == "abT" else (b, k, n)


def _layout_rates(rate, b: int, m: int, k: int, n: int, layout: str) -> tuple[float, float]:
    """(XLA's, PyTorch's) GFLOP/s of the product (batch, m, k, n) with its operands stored as `layout` says."""
    import jax
    import jax.numpy as jnp
    import torch

    first, second = _operands(b, m, k, n, layout)
    x, y = jax.random.normal(jax.random.key(0), first), jax.random.normal(jax.random.key(1), second)
    mul = jax.jit(lambda x, y: jnp.einsum(LAYOUTS[layout], x, y))
    tx, ty = torch.randn(first), torch.randn(second)
    tx, ty = (tx.transpose(1, 2), ty) if layout == "aTb" else (tx, ty.transpose(1, 2) if layout == "abT" else ty)
    flops = 2.0 * b * m * k * n
    return (rate(lambda: mul(x, y).block_until_ready(), flops), rate(lambda: torch.matmul(tx, ty), flops))


def _products(dims: list[tuple[int, int, int, int]], layouts: tuple[str, ...] = tuple(LAYOUTS)
              ) -> list[tuple[float, float]]:  # fmt: skip
    """(XLA's, PyTorch's) best GFLOP/s of each float32 product (batch, m, k, n), (batch, m, k) @ (batch, k, n),
    over `layouts` of its operands."""
    import jax.numpy as jnp
    import torch

    rate, out, seen = _timer(), [], {}
    warm = torch.randn(1024, 1024)
    for _ in range(20):  # both libraries' thread pools started before the first timing
        torch.matmul(warm, warm), (jnp.ones((1024, 1024)) @ jnp.ones((1024, 1024))).block_until_ready()
    for dim in dims:
        if dim not in seen:  # a shape met before (a dense layer's forward and its input's gradient)
            rates = [_layout_rates(rate, *dim, layout) for layout in layouts]
            seen[dim] = (max(r[0] for r in rates), max(r[1] for r in rates))
        out.append(seen[dim])
    return out


def square_rates(sizes: tuple[int, ...] = (1024, 2048, 4096)) -> dict[str, float]:
    """GFLOP/s of a float32 n x n x n product in XLA and in PyTorch."""
    rates = {}
    for n, (xla, torch_rate) in zip(sizes, _products([(1, n, n, n) for n in sizes], ("ab",)), strict=True):
        rates[f"XLA {n}"], rates[f"PyTorch {n}"] = xla, torch_rate
    return rates


def step_products(cfg: ModelConfig, rows: int, length: int) -> list[tuple[int, int, int, int, int]]:
    """The products of a training step on `rows` x `length` tokens, as (count, batch, m, k, n): each dense layer's
    forward, its input's gradient and its weight's gradient; the attention's two products forward and four
    backward, per head."""
    t, d, f, heads, layers = rows * length, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_layers
    h = d // heads
    dense = [(4, t, d, d), (1, t, d, f), (1, t, f, d)]  # q k v o, MLP in, MLP out: x @ W
    grads = [(4, t, d, d), (1, t, f, d), (1, t, d, f)]  # g @ W^T
    weights = [(4, d, t, d), (1, d, t, f), (1, f, t, d)]  # x^T @ g
    out = [(c * layers, 1, m, k, n) for c, m, k, n in dense + grads + weights]
    out += [(2 * layers, rows * heads, length, h, length), (4 * layers, rows * heads, length, length, h)]
    return out


def fused_attention_rate(rows: int, length: int, heads: int, h: int) -> float:
    """GFLOP/s of PyTorch's fused attention (scaled_dot_product_attention), forward and backward, counting the
    six products' FLOPs of the plain form."""
    import torch

    q, k, v = (torch.randn(rows, heads, length, h, requires_grad=True) for _ in range(3))
    grad = torch.randn(rows, heads, length, h)

    def run() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v).backward(grad)

    return _timer()(run, 6 * 2.0 * rows * heads * length * length * h)


def products_rate(cfg: ModelConfig, rows: int, length: int) -> tuple[float, list[dict]]:
    """The rate of a training step's products if each ran at the fastest rate XLA or PyTorch reach for its shape in
    any of its layouts, the attention's at that or at PyTorch's fused attention's, the faster: its FLOPs over the
    sum of their times; and each shape's rates."""
    products = step_products(cfg, rows, length)
    heads, h = cfg.num_heads, cfg.hidden_size // cfg.num_heads
    rates = _products([p[1:] for p in products])
    flops = [2.0 * c * b * m * k * n for c, b, m, k, n in products]
    dense = sum(fl / max(r) / 1e9 for fl, r in zip(flops[:-2], rates[:-2], strict=True))
    attention = sum(fl / max(r) / 1e9 for fl, r in zip(flops[-2:], rates[-2:], strict=True))
    fused = fused_attention_rate(rows, length, heads, h)
    shapes = [{"count": p[0], "shape": "x".join(map(str, p[1:])), "xla_gflops": r[0], "torch_gflops": r[1]}
              for p, r in zip(products, rates, strict=True)]  # fmt: skip
    shapes.append({"count": cfg.num_layers, "shape": f"fused attention {rows}x{heads}x{length}x{h}",
                   "xla_gflops": float("nan"), "torch_gflops": fused})  # fmt: skip
    attention = min(attention, sum(flops[-2:]) / fused / 1e9)
    return sum(flops) / (dense + attention) / 1e9, shapes


def _walls(results: str) -> dict[str, float]:
    """Each system's mean wall time in a results file of the end-to-end benchmarks."""
    walls: dict[str, list[float]] = {}
    for row in json.loads(Path(results).read_text())["rows"]:
        if "wall_s" in row:
            walls.setdefault(row["system"], []).append(row["wall_s"])
    return {system: statistics.mean(w) for system, w in walls.items()}


def _rows(work: Work, cfg: ModelConfig, walls: dict[str, float], ratio: float) -> tuple[list[dict], dict[str, float]]:
    """The table's rows: each system's wall time and its useful rate, the baseline's rate at its own padding, and
    the rate the target leaves; with the FLOP counts."""
    flops = least_flops(work, cfg)
    bertforge = next(s for s in walls if s.startswith("bertforge"))
    baseline = next(s for s in walls if not s.startswith("bertforge"))
    padded = padded_flops(work, cfg, work.baseline_evaluations)
    rows = [{"what": s, "wall_s": w, "tflop": flops["total"] / 1e12} for s, w in walls.items()]
    rows.append({"what": f"{baseline}, at its padding", "wall_s": walls[baseline], "tflop": padded / 1e12})
    target = ratio * walls[baseline]
    rows.append({"what": f"{ratio:g}x the baseline's wall, all of it arithmetic", "wall_s": target,
                 "tflop": flops["total"] / 1e12})  # fmt: skip
    for r in rows:
        r["gflops"] = r["tflop"] * 1e3 / r["wall_s"]
    counts = {"least_train_tflop": flops["train"] / 1e12, "least_valid_tflop": flops["valid"] / 1e12,
              "baseline_padded_tflop": padded / 1e12, "bertforge_wall_s": walls[bertforge]}  # fmt: skip
    return rows, counts


# Per task: its default maximum length, and a typical step of bertforge's (CommonLit's median rung, JSQuAD's packed
# batches, the short sentences' packed micro-batch).
STEP = {"commonlit": (256, 16, 224), "jsquad": (128, 38, 128), "sentences": (64, 5, 64)}


def _work(p: argparse.ArgumentParser, args: argparse.Namespace) -> Work:
    max_length = args.max_length or STEP[args.task][0]
    if args.task == "commonlit":
        if not args.folds:
            p.error("--task commonlit needs --folds")
        return commonlit_work(args.data, args.folds, max_length)
    if args.task == "sentences":
        if not args.valid_data:
            p.error("--task sentences needs --valid-data")
        return sentences_work(args.data, args.valid_data, max_length)
    return jsquad_work(args.data, max_length, args.train_fraction)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", choices=list(STEP), required=True)
    p.add_argument(
        "--data",
        required=True,
        help="commonlit: the competition's train.csv; jsquad: valid-v1.3.json; sentences: train.csv",
    )
    p.add_argument("--valid-data", help="sentences: the validation table finetune_end_to_end.py wrote")
    p.add_argument("--folds", help="commonlit: the folds.csv that the end-to-end benchmark's bertforge run wrote")
    p.add_argument("--results", required=True, help="the end-to-end benchmark's results .json (its wall times)")
    p.add_argument("--metrics", help="a bertforge run's metrics.jsonl: its step beside the products' ceiling")
    p.add_argument("--ratio", type=float, default=0.5, help="the target: this fraction of the baseline's wall time")
    p.add_argument("--max-length", type=int, default=None, help="default: 256 / 128 / 64 (per --task)")
    p.add_argument("--train-fraction", type=float, default=0.5)
    p.add_argument("--rows", type=int, default=None, help="a step's rows for its products; default 16 / 38 / 5")
    p.add_argument("--length", type=int, default=None, help="their length; default 224 / 128 / 64")
    p.add_argument("--name", default=None, help="results name; default compute_bound_<task>")
    args = p.parse_args()
    work = _work(p, args)
    config = Path(_minilm()) / "config.json"
    cfg, _ = config_from_hf(json.loads(config.read_text()), str(config))
    rows, counts = _rows(work, cfg, _walls(args.results), args.ratio)
    step_rows, length = args.rows or STEP[args.task][1], args.length or STEP[args.task][2]
    ceiling, shapes = products_rate(cfg, step_rows, length)
    counts |= {"step_rows": step_rows, "step_length": length, "products_gflops": ceiling}
    if args.metrics:
        step_s, ceiling_s = logged_step_s(args.metrics), step_flops(cfg, step_rows, length) / ceiling / 1e9
        counts |= {"bertforge_step_s": step_s, "products_step_s": ceiling_s, "of_ceiling": ceiling_s / step_s}
    _report(args, rows, counts, square_rates(), shapes)


def _report(args: argparse.Namespace, rows: list[dict], counts: dict, squares: dict[str, float], shapes: list[dict]
            ) -> None:  # fmt: skip
    from report import save

    lines = ["| what | wall time | model FLOPs | FLOP/s over the wall time |", "|---|---|---|---|"]
    lines += [f"| {r['what']} | {r['wall_s']:.0f} s | {r['tflop']:.1f} T | {r['gflops']:.0f} G |" for r in rows]
    ceiling, step = counts["products_gflops"], f"{counts['step_rows']} x {counts['step_length']}"
    lines += [f"| a step's products ({step} tokens), each at the faster library's rate (the attention: its products "
              f"or PyTorch's fused kernel, the faster) | - | - | "
              f"{ceiling:.0f} G |"]  # fmt: skip
    lines += [f"| float32 product {n} x {n} x {n}, {who} | - | - | {g:.0f} G |"
              for key, g in squares.items() for who, n in [key.split()]]  # fmt: skip
    lines += ["", "| a step's product (batch x m x k x n), times a step | XLA | PyTorch |", "|---|---|---|"]
    lines += [f"| {s['shape']}, {s['count']} | {s['xla_gflops']:.0f} G | {s['torch_gflops']:.0f} G |" for s in shapes]
    lines = [line.replace("nan G", "-") for line in lines]
    needed, best = rows[-1]["gflops"], max(squares.values())
    lines += ["", f"The least exact work: {counts['least_train_tflop']:.1f} TFLOP of training and "
              f"{counts['least_valid_tflop']:.1f} of evaluation. {args.ratio:g}x the baseline's wall time needs "
              f"{needed:.0f} GFLOP/s of it from start to end: {needed / ceiling:.2f}x the rate of a step's products "
              f"alone, each at the faster library's rate ({ceiling:.0f} GFLOP/s), and "
              f"{needed / best:.2f}x the fastest square product ({best:.0f})."]  # fmt: skip
    if "bertforge_step_s" in counts:
        lines += ["", f"bertforge's training step ({step} tokens, the median of its logged windows after the first): "
                  f"{counts['bertforge_step_s'] * 1e3:.0f} ms; its products at the faster library's rates: "
                  f"{counts['products_step_s'] * 1e3:.0f} ms, {counts['of_ceiling']:.2f} of the step."]  # fmt: skip
    title = (
        f"The least arithmetic of the {args.task} benchmark (all-MiniLM-L6-v2, float32) against this machine's "
        f"float32 products, 2 CPU cores ({cpu_model()}); wall times from {Path(args.results).name}"
    )
    bars = [(r["what"][:48], r["gflops"], "tab:blue" if r["what"].startswith("bertforge") else "tab:gray")
            for r in rows]  # fmt: skip
    bars[-1] = (bars[-1][0], needed, "tab:red")
    bars += [(f"a step's products ({step})", ceiling, "tab:green")]
    bars += [(key, g, "tab:olive") for key, g in squares.items()]
    save(args.name or f"compute_bound_{args.task}", title, "\n".join(lines), rows + [counts, squares, *shapes],
         bars, "GFLOP/s: model FLOPs over wall time, and float32 products' rates")  # fmt: skip


if __name__ == "__main__":
    main()
