"""Where a pretraining step's device time goes: the accelerator suite's MLM step (BERT-base at 256 x 128 by
default) timed, then traced for a few steps, its kernels summed by kind (matrix products, attention, fused
element-wise and reduction kernels, copies) and by name, for bertforge's variants (as the suite runs it, with
`explicit` attention, without dropout, without attention dropout alone, with the hand-written attention backward)
and for transformers eager (SDPA, bf16 autocast).

Each variant runs in a fresh process under its own deadline; the table is written after every variant. The kernel
time per step against the step's wall time says how much of the step is the device idle (launch gaps, host work).

    PYTHONPATH=src:benchmarks python3 benchmarks/step_kernels.py --out <folder>
    .venv/bin/python benchmarks/step_kernels.py --smoke      # tiny shapes on the CPU: a check of the script
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import accelerator_suite as suite  # noqa: E402

# name: (implementation, model config overrides)
VARIANTS = {
    # `auto`: on a GPU, the fused Pallas kernels with dropout on the probabilities.
    "bertforge bf16": ("jax", {}),
    # The einsums and softmax written out, the GPU's choice with attention dropout before the Pallas kernels.
    "bertforge bf16, attention explicit": ("jax", {"attention": "explicit"}),
    "bertforge bf16, no dropout": ("jax", {"hidden_dropout": 0.0, "attention_dropout": 0.0}),
    # Without attention dropout the step takes cuDNN's fused attention: what the probabilities' dropout costs.
    "bertforge bf16, hidden dropout only": ("jax", {"attention_dropout": 0.0}),
    # The hand-written backward (the CPU's choice) in place of `explicit`, with the same dropout.
    "bertforge bf16, attention custom": ("jax", {"attention": "custom"}),
    "transformers eager bf16 autocast": ("torch", {}),
}
# Kinds of kernel, by words in their names (cuBLAS, cuDNN, XLA's fusions, Triton, PyTorch's own), first match wins.
KINDS = [
    ("attention", ("sdpa", "fmha", "flash", "cudnn", "attention", "softmax")),
    ("matmul", ("gemm", "xmma", "nvjet", "cutlass", "cublas", "sm90_", "sm80_", "matmul", "dot")),
    ("copy", ("memcpy", "memset", "copy", "transpose", "concatenate", "dynamic_update_slice", "scatter", "gather")),
    ("reduction", ("reduce", "reduction", "norm", "sum")),
    ("element-wise", ("fusion", "elementwise", "vectorized", "triton_poi", "unrolled", "loop_")),
]
TRACED_STEPS = 3
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")  # PyTorch's device events


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, words in KINDS if any(w in low for w in words)), "other")


def device_events(trace: dict | list) -> tuple[list[dict], str]:
    """A Chrome/Perfetto trace's kernel events: those of a device process's streams (JAX's `/device:...` processes;
    PyTorch's kernels and copies); on a CPU, XLA's own threads stand in for a device. -> (events, their source)"""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    named = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    threads = {(e["pid"], e.get("tid")): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}  # fmt: skip
    complete = [e for e in events if e.get("ph") == "X" and "dur" in e]
    found = [e for e in complete if str(named.get(e["pid"], "")).startswith("/device:") or e.get("cat") in GPU_CATS]
    # A JAX device process also has lines of XLA modules and ops over the same time: keep its streams' kernels.
    streams = [e for e in found if threads.get((e["pid"], e.get("tid")), "").startswith("Stream")]
    if streams or found:
        return streams or found, "device streams" if streams else "device"
    return [e for e in complete if threads.get((e["pid"], e.get("tid")), "").startswith("tf_XLA")], "host threads"


def busy_us(events: list[dict]) -> float:
    """Microseconds during which at least one kernel runs (overlapping kernels on several streams counted once)."""
    total, end = 0.0, -np.inf
    for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def summarize(found: tuple[list[dict], str], steps: int, top: int = 20) -> dict:
    """Kernel events of `steps` steps -> per-step milliseconds by kind and for the `top` kernels by time."""
    events, source = found
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        by_name[e["name"]].append(e["dur"])
    by_kind: dict[str, float] = collections.Counter()
    for name, durs in by_name.items():
        by_kind[kind_of(name)] += sum(durs)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "source": source,
        "events": len(events),
        "kernel_ms": sum(by_kind.values()) / steps / 1e3,
        "busy_ms": busy_us(events) / steps / 1e3,
        "kinds": {k: v / steps / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top": [
            {"name": n, "kind": kind_of(n), "calls": len(d) / steps, "ms": sum(d) / steps / 1e3} for n, d in ranked
        ],  # fmt: skip
    }


def load_trace(folder: Path) -> dict | list:
    found = glob.glob(str(folder / "**/*trace.json*"), recursive=True)
    if not found:
        raise FileNotFoundError(f"no trace under {folder}")
    path = found[0]
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as fh:
        return json.load(fh)


# ------------------------------------------------------------------------------------------------------ children
def run_jax(part: suite.Part, shape: suite.Shape, overrides: dict, trace_dir: Path) -> dict:
    import jax

    compiled, (state, *batch), compile_s = suite.bertforge_pretrain_step(part, shape, **overrides)
    state, metrics, times = suite.timed_steps(compiled, state, batch, shape.steps)
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(TRACED_STEPS):
            state, metrics = compiled(state, *batch)
        jax.block_until_ready(metrics["loss"])
    profile = summarize(device_events(load_trace(trace_dir)), TRACED_STEPS)
    return {"step_s": float(np.median(times)), "compile_s": compile_s, "profile": profile}


def run_torch(part: suite.Part, shape: suite.Shape, device: str, trace_dir: Path) -> dict:
    import torch
    from timing import torch_timed

    model, opt, loss = suite.torch_pretrain_setup(part, shape, device)
    timed = torch_timed(model, opt, loss, device, compiled=False, warm=1, steps=shape.steps)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        torch_timed(model, opt, loss, device, compiled=False, warm=0, steps=TRACED_STEPS)
    prof.export_chrome_trace(str(trace_dir / "torch.trace.json"))
    return {"step_s": timed["step_s"], "profile": summarize(device_events(load_trace(trace_dir)), TRACED_STEPS)}


def child(spec: dict) -> dict:
    part, shape = suite.PARTS[spec["part"]], suite.Shape(**spec["shape"])
    impl, overrides = VARIANTS[spec["variant"]]
    with tempfile.TemporaryDirectory() as tmp:
        if impl == "jax":
            return run_jax(part, shape, overrides, Path(tmp))
        return run_torch(part, shape, spec["device"], Path(tmp))


# ------------------------------------------------------------------------------------------------------ results
def table(rows: list[dict]) -> str:
    kinds = [k for k, _ in KINDS] + ["other"]
    head = ["variant", "step ms", "kernels ms", "busy ms", "idle ms", *[f"{k} ms" for k in kinds]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "profile" not in r:
            lines.append(f"| {r['variant']} | {r['failed']} |" + " |" * (len(head) - 2))
            continue
        p, step = r["profile"], r["step_s"] * 1e3
        cells = [r["variant"], f"{step:.1f}", f"{p['kernel_ms']:.1f}", f"{p['busy_ms']:.1f}",
                 f"{max(step - p['busy_ms'], 0.0):.1f}", *[f"{p['kinds'].get(k, 0.0):.1f}" for k in kinds]]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def top_tables(rows: list[dict]) -> str:
    out = []
    for r in rows:
        if "profile" not in r:
            continue
        p = r["profile"]
        out += [f"\n{r['variant']}: the longest kernels ({p['events']} events of {p['source']})\n",
                "| kernel | kind | calls per step | ms per step |", "|---|---|---|---|"]  # fmt: skip
        for k in r["profile"]["top"]:
            out.append(f"| `{k['name'][:90]}` | {k['kind']} | {k['calls']:g} | {k['ms']:.2f} |")
    return "\n".join(out)


def write(out: Path, title: str, rows: list[dict], plot: bool = False) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_kernels.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    (out / "step_kernels.md").write_text(f"{title}\n\n{table(rows)}\n{top_tables(rows)}\n")
    if plot:
        plot_kinds(rows, title, out / "step_kernels.png")


def plot_kinds(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "profile" in r]
    kinds = [k for k, _ in KINDS] + ["other", "idle"]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * len(rows)))
    left = np.zeros(len(rows))
    for kind in kinds:
        ms = np.array([max(r["step_s"] * 1e3 - r["profile"]["busy_ms"], 0.0) if kind == "idle"
                       else r["profile"]["kinds"].get(kind, 0.0) for r in rows])  # fmt: skip
        ax.barh([r["variant"] for r in rows], ms, left=left, label=kind)
        left += ms
    ax.set_xlabel("milliseconds per step (kernels summed; idle = step minus busy)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=len(kinds), loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="pretrain-bert", choices=["pretrain-bert", "pretrain-modernbert"])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="the part's tiny shape on the CPU")
    ap.add_argument("--deadline", type=float, default=100.0, help="seconds for each variant's process")
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    device, _ = suite.device_name()
    part = suite.PARTS[args.part]
    shape = part.smoke if args.smoke else part.full
    title = f"{part.title}, {shape.rows} x {shape.seq}, on {device}"
    spec = {"part": args.part, "shape": vars(shape), "device": "cuda" if not device.startswith("CPU") else "cpu"}
    rows: list[dict] = []
    for variant in args.variants:
        cmd = [sys.executable, __file__, "--child", json.dumps({**spec, "variant": variant})]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.deadline, check=False)
            last = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else []
            row = json.loads(last[0]) if last else {"failed": suite.last_error(proc.stderr)}
        except subprocess.TimeoutExpired:
            row = {"failed": f"stopped at its deadline ({args.deadline:.0f} s)"}
        rows.append({"variant": variant, **row})
        write(Path(args.out), title, rows)
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    write(Path(args.out), title, rows, plot=True)
    print(f"{title}\n\n{table(rows)}\n{top_tables(rows)}")


if __name__ == "__main__":
    main()
