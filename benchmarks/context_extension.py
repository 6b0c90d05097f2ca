"""Context extension (configs/pretrain/wikitext-modernbert-phases.yaml, the ModernBERT recipe scaled down to a mini):
the masked-LM loss on long held-out documents of the model before its extension phase, after it, and of a control
that spends the extension's tokens at the short length and the old theta instead.

Data: WikiText-2 (`make data` fetches it). The tokenizer (WordPiece, 16k, lowercase) and the training shards come from
its validation split, at 128 tokens for the first phase and 512 for the extension; the evaluation reads the articles
of its test split, never trained on: consecutive blocks of 504 tokens inside one article, 15% of their tokens
replaced by [MASK] (one seeded choice for every model), scored two ways: the whole block in one row of 506 tokens
([CLS] block [SEP]), and the same block cut into 4 rows of 126 tokens, so that the two lengths score the same masked
tokens and differ only in the context each token sees. The exported folders are scored by transformers'
ModernBertForMaskedLM in PyTorch, so the evaluation shares no code with the training.

Runs, each the shipped config with its second phase's shard folder pointed at this script's:
- `extension`: 240 steps of 16 x 128 tokens at theta 10,000 (warmup, constant), then 60 steps of 16 x 512 at a global
  theta of 160,000 with the 1-sqrt decay; scored at step 240 (`before extension`) and at its end.
- `control`: the same first phase, then 240 steps of 16 x 128 at theta 10,000 with the same decay (the extension's
  tokens, at the short length).
Index lines per scored length: bertforge is the extended model; the references are the model before its extension
(time: its run's seconds to step 240) and the control (its run's wall time). Each phase's tokens per second come from
a short run of the recipe (40 + 20 steps, nothing else between) made first, lines of their own.

    .venv/bin/python benchmarks/context_extension.py --out runs/context-extension
    .venv/bin/python benchmarks/context_extension.py --out runs/context-extension --speed-only
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
import results_index  # noqa: E402

BIN = ROOT / ".venv/bin/bertforge"
CONFIG = ROOT / "configs/pretrain/wikitext-modernbert-phases.yaml"
BLOCK, PIECES = 504, 4  # tokens of a block, rows of the short scoring (126 each: 128 with [CLS] and [SEP])


def _run(command: list, log) -> float:
    log.write("$ " + " ".join(map(str, command)) + "\n")
    log.flush()
    start = time.perf_counter()
    done = subprocess.run(list(map(str, command)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - start
    log.write(done.stdout + f"# {wall:.0f} s, exit {done.returncode}\n")
    log.flush()
    if done.returncode:
        sys.exit(f"{command[1]} failed: see {log.name}")
    return wall


def prepare(root: Path, out: Path, log) -> dict[str, Path]:
    """The tokenizer and the 128- and 512-token shard folders of WikiText-2's validation split."""
    text = root / "wikitext-2" / "valid.txt"
    paths = {"tok": out / "tok", "128": out / "shards-128", "512": out / "shards-512"}
    _run([BIN, "tokenizer", "train", "--files", text, "--type", "wordpiece", "--vocab-size", "16000", "--lowercase",
          "--out", paths["tok"]], log)  # fmt: skip
    for length in ("128", "512"):
        _run([BIN, "preprocess", "--tokenizer", paths["tok"], "--files", text, "--out", paths[length],
              "--seq-len", length], log)  # fmt: skip
    return paths


def configs(out: Path, shards_512: Path) -> dict[str, Path]:
    """The shipped recipe with its extension reading `shards_512`, and the control: a second phase at 128 tokens and
    the first phase's theta for the extension's tokens."""
    recipe = yaml.safe_load(CONFIG.read_text(encoding="utf-8"))
    recipe["checkpoint"]["keep_last"] = 10  # step 240's checkpoint is scored after the run
    first, extend = recipe["phases"]
    extend["data"]["shards"] = str(shards_512)
    control = {**extend, "name": "control-128", "steps": extend["steps"] * 4, "data": {}, "model": {}}
    paths = {"extension": out / "extension.yaml", "control": out / "control.yaml"}
    paths["extension"].write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    paths["control"].write_text(yaml.safe_dump({**recipe, "phases": [first, control]}, sort_keys=False), "utf-8")
    return paths


def speed_config(out: Path, extension: Path) -> Path:
    """The extension recipe cut to 40 + 20 steps with no evaluation or checkpoint between: each phase's speed."""
    recipe = yaml.safe_load(extension.read_text(encoding="utf-8"))
    recipe["phases"][0]["steps"], recipe["phases"][1]["steps"] = 40, 20
    recipe["eval"]["every"] = recipe["checkpoint"]["every"] = 1000
    path = out / "speed.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return path


def articles(path: Path) -> list[str]:
    """WikiText's articles: the text under each top-level heading (` = Title = `)."""
    out: list[list[str]] = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if re.fullmatch(r" = [^=].* = ", line):
            out.append([])
        elif out and line.strip():
            out[-1].append(line.strip())
    return [" ".join(lines) for lines in out if lines]


def blocks(tokenizer_json: Path, texts: list[str], count: int) -> np.ndarray:
    """(N, BLOCK) consecutive token blocks inside single articles, at most `count`."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    out = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False).ids
        out += [ids[i : i + BLOCK] for i in range(0, len(ids) - BLOCK + 1, BLOCK)]
    return np.asarray(out[:count], np.int64)


def mlm_losses(folder: Path, ids: np.ndarray, seed: int, batch: int = 8) -> dict[str, float]:
    """The mean cross-entropy over the masked tokens of `ids`, in rows of the whole block and of PIECES pieces."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForMaskedLM

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cls, sep, mask = (tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[MASK]"))
    masked = np.random.default_rng(seed).random(ids.shape) < 0.15  # (N, BLOCK), the same for every model
    inputs = np.where(masked, mask, ids)
    model = AutoModelForMaskedLM.from_pretrained(folder, attn_implementation="eager").eval()
    torch.set_num_threads(2)

    def score(rows: np.ndarray, targets: np.ndarray, chosen: np.ndarray) -> float:
        wrap = lambda a, fill: np.concatenate([np.full((len(a), 1), fill), a, np.full((len(a), 1), fill)], 1)  # noqa: E731
        x = wrap(rows, 0)
        x[:, 0], x[:, -1] = cls, sep
        labels = np.where(wrap(chosen, False), wrap(targets, -100), -100)
        total, count = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(x), batch):
                logits = model(input_ids=torch.tensor(x[i : i + batch])).logits
                y = torch.tensor(labels[i : i + batch])
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
                total, count = total + float(loss), count + int((y != -100).sum())
        return total / count

    piece = BLOCK // PIECES
    cut = lambda a: a.reshape(len(a) * PIECES, piece)  # noqa: E731
    return {
        f"{BLOCK + 2} tokens": score(inputs, ids, masked),
        f"{piece + 2} tokens": score(cut(inputs), cut(ids), cut(masked)),
    }


def speeds(run: Path) -> dict[str, float]:
    """Each phase's median tokens per second over its logged steps."""
    by_phase: dict[str, list[float]] = {}
    for text in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(text)
        if "tokens_per_s" in record and "phase" in record:
            by_phase.setdefault(record["phase"], []).append(record["tokens_per_s"])
    return {phase: float(np.median(values)) for phase, values in by_phase.items()}


def elapsed_at(run: Path, step: int) -> float:
    """The run's own clock (seconds since its start) at `step`."""
    for text in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(text)
        if record.get("step") == step and "elapsed" in record:
            return float(record["elapsed"])
    raise SystemExit(f"{run}/metrics.jsonl has no elapsed time at step {step}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", type=Path, default=ROOT.parent / "shared/data")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--blocks", type=int, default=96, help="held-out blocks of 504 tokens scored")
    p.add_argument("--seed", type=int, default=0, help="of the masked tokens")
    p.add_argument("--speed-only", action="store_true", help="only each phase's tokens per second (a short run)")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "benchmark.log", "a", encoding="utf-8") as log:
        paths = prepare(args.data_root, args.out, log)
        recipes = configs(args.out, paths["512"])
        speed_run = args.out / "speed"
        shutil.rmtree(speed_run, ignore_errors=True)  # a fresh run: its speed, not a resumed one's
        _run([BIN, "pretrain", "--config", speed_config(args.out, recipes["extension"]), "--data", paths["128"],
              "--out", speed_run, "--log.tensorboard=false", "--log.progress=false"], log)  # fmt: skip
        if args.speed_only:
            results_index.append(speed_lines(speeds(speed_run)))
            return
        walls, folders = {}, {}
        for name, config in recipes.items():
            run = args.out / name
            walls[name] = _run([BIN, "pretrain", "--config", config, "--data", paths["128"], "--out", run,
                                "--log.tensorboard=false", "--log.progress=false"], log)  # fmt: skip
            folders[name] = args.out / f"{name}-hf"
            _run([BIN, "export", run, "--out", folders[name]], log)
        folders["before"] = args.out / "before-hf"
        _run([BIN, "export", args.out / "extension", "--step", "240", "--out", folders["before"]], log)
    ids = blocks(paths["tok"] / "tokenizer.json", articles(args.data_root / "wikitext-2" / "test.txt"), args.blocks)
    losses = {name: mlm_losses(folder, ids, args.seed) for name, folder in folders.items()}
    walls["before"] = elapsed_at(args.out / "extension", 240)
    print(json.dumps({"losses": losses, "walls": walls, "blocks": len(ids)}, indent=2))
    results_index.append(quality_lines(losses, walls, len(ids)) + speed_lines(speeds(speed_run)))


def quality_lines(losses: dict, walls: dict, n_blocks: int) -> list[dict]:
    """Per scored length, the extended model against the model before its extension and against the control."""
    references = {"before": ("the model before its extension", "ModernBERT mini before its extension",
                             "step 240, 128 tokens, theta 10,000"),
                  "control": ("128-token training of the same tokens", "ModernBERT mini, control",
                              "240 more steps at 128 tokens, theta 10,000")}  # fmt: skip
    lines = []
    for length in losses["extension"]:
        recipe = f"masked-LM loss on {n_blocks} held-out WikiText-2 blocks in rows of {length}"
        metric = f"mlm loss, rows of {length} (lower is better)"
        ours = [{"seed": 0, "wall_s": walls["extension"], "value": losses["extension"][length]}]
        for ref, (against, system, variant) in references.items():
            theirs = [{"seed": 0, "wall_s": walls[ref], "value": losses[ref][length]}]
            lines += [
                results_index.line("context_extension", f"{recipe}, against {against}", "bertforge",
                                   "extended: 60 steps at 512 tokens, theta 160,000", "cold", metric, ours),
                results_index.line("context_extension", f"{recipe}, against {against}", system, variant, "cold",
                                   metric, theirs),
            ]  # fmt: skip
    return lines


def speed_lines(by_phase: dict[str, float]) -> list[dict]:
    """Each phase's tokens per second in the short run (float32, 16 rows a step)."""
    return [
        results_index.line(
            "context_extension",
            f"tokens per second of the recipe, phase {phase}",
            "bertforge",
            "float32, 16 rows a step",
            "warm",  # the median of logged steps: no compilation in it, whatever the cache held
            "tokens_per_s",
            [{"seed": 0, "wall_s": None, "value": speed}],
        )
        for phase, speed in by_phase.items()
    ]


if __name__ == "__main__":
    main()
