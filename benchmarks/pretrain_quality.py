"""Pretraining quality per minute: validation MLM loss against wall-clock time, bertforge against transformers'
Trainer, each system training a mini-sized model (4 layers, hidden 256) for the same wall-clock budget.

One WordPiece tokenizer and one set of shards (`bertforge tokenizer train` and `bertforge preprocess`, 128-token
blocks) serve every system. Every system is run as its users run it: bertforge through its command line, the
Trainer as run_mlm does (DataCollatorForLanguageModeling), each in a fresh process, with its checkpoints (every
--checkpoint-every steps) inside its wall time. Afterwards each checkpoint is evaluated on the same held-out blocks
with the same masked positions (15% of the tokens replaced by [MASK], drawn once with a fixed seed), and placed at
the wall time its folder was written, counted from the launch of the process. Reported: each system's final
validation loss, and the wall time at which it first reached the final loss of transformers' best BERT run.

Systems: transformers Trainer + BertForMaskedLM (fp32, and with bf16 autocast), Trainer + ModernBertForMaskedLM,
bertforge BERT (the 2018 recipe: 15% masking, dropout 0.1, linear decay), bertforge ModernBERT
(configs/pretrain/modernbert-mini.yaml: 30% masking, no dropout, warmup-stable-decay). The Trainer's learning rate
follows the same shapes over the wall clock as bertforge's time budget does (its schedulers count steps).

    .venv/bin/python benchmarks/pretrain_quality.py --data data/wikitext-2/*.txt [--minutes 10]
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BERTFORGE = [sys.executable, "-m", "bertforge.cli"]
MINI = {"num_layers": 4, "hidden_size": 256, "num_heads": 4}
EVAL_RATE, EVAL_SEED = 0.15, 1234
SENTENCES = [
    "The capital of France is [MASK].",
    "He played the [MASK] in the school band.",
    "The river flows into the [MASK].",
    "She was born in [MASK] in 1950.",
    "The film was released in [MASK] 2010.",
    "The church was built in the [MASK] century.",
    "The team won the [MASK] in the final game.",
    "The album reached number one on the [MASK] chart.",
]
SYSTEMS = {
    "transformers-bert-fp32": "transformers Trainer, BertForMaskedLM, fp32",
    "transformers-bert-bf16": "transformers Trainer, BertForMaskedLM, bf16 autocast",
    "transformers-modernbert": "transformers Trainer, ModernBertForMaskedLM, fp32",
    "bertforge-bert": "bertforge BERT (2018 recipe), fp32",
    "bertforge-modernbert": "bertforge ModernBERT (its recipe), fp32",
}
# The recipes: masking rate, dropout, schedule; the same batch, lr and warmup share for all.
RECIPES = {
    "bert": {"rate": 0.15, "dropout": 0.1, "schedule": "linear", "weight_decay": 0.01},
    "modernbert": {"rate": 0.3, "dropout": 0.0, "schedule": "wsd", "weight_decay": 1e-5},
}
LR, WARMUP, DECAY = 1e-3, 0.06, 0.1


# ------------------------------------------------------------------------------------------------------ data
def prepare(args: argparse.Namespace, work: Path) -> tuple[Path, Path]:
    """The tokenizer and the shards every system trains on, and the fixed evaluation batch."""
    tok, shards = work / "tokenizer", work / "shards"
    if not (tok / "tokenizer.json").exists():
        subprocess.run([*BERTFORGE, "tokenizer", "train", "--files", *args.data, "--type", "wordpiece",
                        "--vocab-size", str(args.vocab), "--lowercase", "--out", str(tok)], check=True)  # fmt: skip
    if not (shards / "manifest.json").exists():
        subprocess.run([*BERTFORGE, "preprocess", "--tokenizer", str(tok), "--files", *args.data, "--out",
                        str(shards), "--seq-len", str(args.seq_len), "--valid-fraction", "0.05"],
                       check=True)  # fmt: skip
    manifest = json.loads((shards / "manifest.json").read_text())
    valid = np.concatenate([np.load(shards / s["path"]) for s in manifest["splits"]["valid"]["shards"]]).astype(
        np.int64
    )
    special = set(manifest["special_ids"]["all"])
    rng = np.random.default_rng(EVAL_SEED)
    maskable = ~np.isin(valid, list(special))
    chosen = maskable & (rng.random(valid.shape) < EVAL_RATE)
    inputs = np.where(chosen, manifest["special_ids"]["mask"], valid).astype(np.int64)
    labels = np.where(chosen, valid, -100).astype(np.int64)
    np.savez(work / "eval.npz", inputs=inputs, labels=labels, pad=manifest["special_ids"]["pad"])
    return tok, shards


def train_rows(shards: Path) -> np.ndarray:
    manifest = json.loads((shards / "manifest.json").read_text())
    return np.concatenate([np.load(shards / s["path"]) for s in manifest["splits"]["train"]["shards"]])


# ------------------------------------------------------------------------------------------------------ schedules
def lr_factor(progress: float, schedule: str) -> float:
    """The shapes bertforge's learning_rate gives (linear warmup, then linear decay or warmup-stable-decay)."""
    p = min(max(progress, 0.0), 1.0)
    if p < WARMUP:
        return p / WARMUP
    if schedule == "linear":
        return 1 - (p - WARMUP) / (1 - WARMUP)
    start = 1 - DECAY
    return 1.0 if p <= start else 1 - math.sqrt((p - start) / (1 - start))


# ------------------------------------------------------------------------------------------------------ systems
def bertforge_command(arch: str, recipe_name: str, args: argparse.Namespace, shards: Path, out: Path) -> list[str]:
    """`bertforge pretrain` of the mini model of `arch` (bert, modernbert) with the recipe `recipe_name`."""
    recipe = RECIPES[recipe_name]
    common = [
        "pretrain", "--data", str(shards), "--out", str(out), "--model.preset=mini",
        f"--train.global_batch={args.batch}", f"--train.time_budget_minutes={args.minutes}",
        f"--optim.lr={LR}", "--optim.warmup_steps=0", f"--optim.warmup_fraction={WARMUP}",
        f"--optim.weight_decay={recipe['weight_decay']}", f"--mlm.rate={recipe['rate']}", "--train.max_steps=null",
        f"--checkpoint.every={args.checkpoint_every}", "--checkpoint.keep_last=1000", "--checkpoint.keep_best=0",
        "--eval.every=1000000", "--log.every=10", "--log.tensorboard=false", "--log.progress=false",
    ]  # fmt: skip
    if arch == "modernbert":
        common += [
            "--config",
            str(ROOT / "configs/pretrain/modernbert-mini.yaml"),
            "--model.max_position_embeddings=512",
        ]
    drop = recipe["dropout"]
    common += [f"--model.hidden_dropout={drop}", f"--model.attention_dropout={drop}"]
    common += [f"--optim.schedule={recipe['schedule']}", f"--optim.decay_fraction={DECAY}"]
    return [*BERTFORGE, *common]


def run_bertforge(arch: str, args: argparse.Namespace, shards: Path, out: Path) -> None:
    subprocess.run(bertforge_command(arch, arch, args, shards, out), check=True)


def run_transformers(system: str, args: argparse.Namespace, tok: Path, shards: Path, out: Path) -> None:
    cmd = [sys.executable, __file__, "--worker", system, "--tok", str(tok), "--shards", str(shards), "--out",
           str(out), "--minutes", str(args.minutes), "--batch", str(args.batch), "--checkpoint-every",
           str(args.checkpoint_every)]  # fmt: skip
    subprocess.run(cmd, check=True)


def transformers_worker(args: argparse.Namespace) -> None:
    """Trainer as run_mlm runs it, on the shards' blocks, for a wall-clock budget."""
    import torch
    from transformers import (
        AutoTokenizer,
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        ModernBertConfig,
        ModernBertForMaskedLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    arch = "modernbert" if "modernbert" in args.worker else "bert"
    recipe = RECIPES[arch]
    tok = AutoTokenizer.from_pretrained(args.tok)
    rows = train_rows(Path(args.shards))
    pad = tok.pad_token_id

    class Blocks(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(rows)

        def __getitem__(self, i: int) -> dict:
            ids = rows[i].astype(np.int64)
            return {"input_ids": ids, "attention_mask": (ids != pad).astype(np.int64)}

    sizes = dict(hidden_size=MINI["hidden_size"], num_hidden_layers=MINI["num_layers"],
                 num_attention_heads=MINI["num_heads"], vocab_size=len(tok), pad_token_id=pad)  # fmt: skip
    torch.manual_seed(0)
    if arch == "bert":
        drop = recipe["dropout"]
        config = BertConfig(intermediate_size=4 * MINI["hidden_size"], max_position_embeddings=512,
                            hidden_dropout_prob=drop, attention_probs_dropout_prob=drop, **sizes)  # fmt: skip
        model = BertForMaskedLM(config)
    else:
        config = ModernBertConfig(intermediate_size=384, max_position_embeddings=512,
                                  cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
                                  bos_token_id=None, eos_token_id=None, **sizes)  # fmt: skip
        model = ModernBertForMaskedLM(config)
    budget = args.minutes * 60

    class Clock(TrainerCallback):
        start = 0.0

        def on_train_begin(self, *a, **k):
            Clock.start = time.perf_counter()

        def on_step_end(self, _args, state, control, **k):
            if time.perf_counter() - Clock.start >= budget:
                control.should_training_stop = True
                control.should_save = True

    class TimedTrainer(Trainer):
        def create_scheduler(self, num_training_steps, optimizer=None):
            factor = lambda _step: lr_factor((time.perf_counter() - Clock.start) / budget, recipe["schedule"])  # noqa: E731
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or self.optimizer, factor)
            return self.lr_scheduler

    training = TrainingArguments(
        output_dir=args.out,
        per_device_train_batch_size=args.batch,
        max_steps=10**7,  # the clock stops it
        learning_rate=LR,
        weight_decay=recipe["weight_decay"],
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-6,
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=args.checkpoint_every,
        save_only_model=True,
        logging_steps=10,
        report_to="none",
        use_cpu=True,
        bf16="bf16" in args.worker,
        seed=0,
        dataloader_num_workers=0,
    )
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=recipe["rate"])
    trainer = TimedTrainer(model=model, args=training, train_dataset=Blocks(), data_collator=collator,
                           callbacks=[Clock()])  # fmt: skip
    trainer.train()


# ------------------------------------------------------------------------------------------------------ evaluation
def checkpoints(system: str, out: Path) -> list[tuple[int, Path]]:
    if system.startswith("bertforge"):
        found = [(int(p.name), p) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    else:
        found = [(int(p.name.split("-")[1]), p) for p in out.glob("checkpoint-*")]
    return sorted(found)


def eval_loss_bertforge(out: Path, step: int, batch: dict) -> float:
    import jax.numpy as jnp

    from bertforge.model.load import load_run

    model = load_run(out, str(step)).model
    model.eval()
    inputs, labels, pad = batch["inputs"], batch["labels"], int(batch["pad"])
    total, count = 0.0, 0
    for i in range(0, len(inputs), 64):
        x, y = inputs[i : i + 64], labels[i : i + 64]
        logits = np.asarray(model(jnp.asarray(x), jnp.asarray((x != pad).astype(np.int32)), jnp.zeros_like(x)))
        total, count = total + _ce_sum(logits, y), count + int((y != -100).sum())
    return total / count


def eval_loss_transformers(folder: Path, batch: dict) -> float:
    import torch
    from transformers import AutoModelForMaskedLM

    model = AutoModelForMaskedLM.from_pretrained(folder, dtype=torch.float32).eval()
    inputs, labels, pad = batch["inputs"], batch["labels"], int(batch["pad"])
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(inputs), 64):
            x, y = inputs[i : i + 64], labels[i : i + 64]
            logits = model(input_ids=torch.tensor(x), attention_mask=torch.tensor((x != pad).astype(np.int64))).logits
            total, count = total + _ce_sum(logits.numpy(), y), count + int((y != -100).sum())
    return total / count


def _ce_sum(logits: np.ndarray, labels: np.ndarray) -> float:
    keep = labels != -100
    z = logits[keep].astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    return float(-logp[np.arange(len(z)), labels[keep]].sum())


def evaluate(system: str, out: Path, launched: float, batch: dict) -> list[dict]:
    curve = []
    for step, path in checkpoints(system, out):
        if system.startswith("bertforge"):
            loss = eval_loss_bertforge(out, step, batch)
        else:
            loss = eval_loss_transformers(path, batch)
        curve.append({"step": step, "wall_s": path.stat().st_mtime - launched, "valid_loss": loss})
        print(f"{system} step {step}: {curve[-1]['wall_s']:.0f} s, validation loss {loss:.4f}", flush=True)
    return curve


def fill_masks(system: str, out: Path, tok: Path) -> list[str]:
    """The top completion of each of SENTENCES by the system's last checkpoint."""
    if system.startswith("bertforge"):
        done = subprocess.run([*BERTFORGE, "fill-mask", "--model", str(out), "--top-k", "1", "--json", *SENTENCES],
                              check=True, capture_output=True, text=True)  # fmt: skip
        return [r["masks"][0][0]["sequence"] for r in json.loads(done.stdout)]
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline

    last = checkpoints(system, out)[-1][1]
    model, tokenizer = AutoModelForMaskedLM.from_pretrained(last), AutoTokenizer.from_pretrained(tok)
    fill = pipeline("fill-mask", model=model, tokenizer=tokenizer)
    return [fill(s, top_k=1)[0]["sequence"] for s in SENTENCES]


# ------------------------------------------------------------------------------------------------------ report
def first_reaching(curve: list[dict], target: float) -> float | None:
    return next((p["wall_s"] for p in curve if p["valid_loss"] <= target), None)


def report(results: dict, minutes: float, name: str) -> None:
    from report import RESULTS, save

    hf_bert = [s for s in results if s.startswith("transformers-bert")]
    best = min(hf_bert, key=lambda s: results[s]["curve"][-1]["valid_loss"])
    target = results[best]["curve"][-1]["valid_loss"]
    hf_mb = results.get("transformers-modernbert")
    mb_target = hf_mb["curve"][-1]["valid_loss"] if hf_mb else None
    lines = [
        f"| system | steps | final validation loss | wall time | reached {best}'s final loss ({target:.3f}) at | "
        "reached transformers ModernBERT's final loss at |",
        "|---|---|---|---|---|---|",
    ]
    rows, bars = [], []
    for system, r in results.items():
        final = r["curve"][-1]
        at = first_reaching(r["curve"], target)
        at_mb = first_reaching(r["curve"], mb_target) if mb_target is not None else None
        fmt = lambda s, wall=r["wall_s"]: "never" if s is None else f"{s:.0f} s ({s / wall:.0%} of its wall time)"  # noqa: E731
        lines.append(
            f"| {SYSTEMS[system]} | {final['step']} | {final['valid_loss']:.3f} | {r['wall_s']:.0f} s | {fmt(at)} "
            f"| {fmt(at_mb)} |"
        )
        rows.append({"system": system, "final_valid_loss": final["valid_loss"], "steps": final["step"],
                     "wall_s": r["wall_s"], "reached_best_bert_at_s": at,
                     "reached_modernbert_at_s": at_mb})  # fmt: skip
        bars.append((SYSTEMS[system], final["valid_loss"], "C0" if system.startswith("bertforge") else "C7"))
    lines += ["", "Fill-mask, top completion after the budget:", ""]
    lines += ["| sentence | " + " | ".join(SYSTEMS[s] for s in results) + " |", "|---" * (len(results) + 1) + "|"]
    for i, sentence in enumerate(SENTENCES):
        lines.append(f"| {sentence} | " + " | ".join(results[s]["fill_mask"][i] for s in results) + " |")
    title = f"Validation MLM loss after {minutes:g} minutes of pretraining a mini model (4 x 256), one run each"
    save(name, title, "\n".join(lines), rows, bars, "final validation MLM loss (lower is better)")

    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, (system, r) in enumerate(results.items()):
        ax.plot([p["wall_s"] / 60 for p in r["curve"]], [p["valid_loss"] for p in r["curve"]], "o-", ms=3,
                color=f"C{i}", label=SYSTEMS[system])  # fmt: skip
    ax.axhline(target, color="k", lw=0.6, ls="--")
    ax.set_xlabel("wall-clock minutes since launch (start-up, compilation and checkpoints included)")
    ax.set_ylabel("validation MLM loss (same blocks, same masks)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}_curves.png", dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", nargs="+", default=sorted(glob.glob(str(ROOT.parent / "shared/data/wikitext-2/*.txt"))))
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock training budget of each system")
    p.add_argument("--systems", nargs="+", choices=list(SYSTEMS), default=list(SYSTEMS))
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--work", default=str(ROOT / "runs/bench-pretrain-quality"))
    p.add_argument("--name", default="pretrain_quality")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--tok", help=argparse.SUPPRESS)
    p.add_argument("--shards", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        transformers_worker(args)
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tok, shards = prepare(args, work)
    batch = dict(np.load(work / "eval.npz"))
    results = {}
    for system in args.systems:
        out = work / system
        shutil.rmtree(out, ignore_errors=True)
        launched = time.time()
        if system.startswith("bertforge"):
            run_bertforge(system.split("-")[1], args, shards, out)
        else:
            run_transformers(system, args, tok, shards, out)
        wall = time.time() - launched
        results[system] = {"wall_s": wall, "curve": evaluate(system, out, launched, batch),
                           "fill_mask": fill_masks(system, out, tok)}  # fmt: skip
        (work / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    report(results, args.minutes, args.name)


if __name__ == "__main__":
    main()
