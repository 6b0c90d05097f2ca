"""Where one XLA program's time goes on a CPU: a bertforge command run once under JAX's profiler with XLA's
per-operation trace events, its program's optimised HLO dumped, every operation's time per execution (the median
over the executions after the first two) summed by kind, and the products' FLOPs counted from the HLO.

The command runs in a child process with an empty compile cache (so its programs are compiled with the trace
events and dumped), exactly as a user runs it otherwise. Kinds follow the names XLA gives its operations: products
(the dense layers', and the attention's batched ones), library fusions without a product (YNNPACK's reductions: the
norms' statistics, the softmax), the exact GELU, copies and transposes, materialised broadcasts, and the other
element-wise fusions. XLA runs some products asynchronously (a `dot` thunk on Eigen's pool: the weights' gradients):
their events cover only the dispatch, and their work shows in the time of the operations that run beside them;
the table counts them apart.

    .venv/bin/python benchmarks/investigations/cpu_step_profile.py --name cpu_step_profile_jsquad_zen4 -- \
        finetune --task embedding \
        --model MINILM --data runs/bench-embedding/jsquad_retrieval_128_frac0.5/train.csv ... --train.epochs=0.25
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks' shared modules

from finetune_end_to_end import cpu_model  # noqa: E402
from report import save  # noqa: E402
from step_kernels import busy_us, load_trace  # noqa: E402

# The child does what the `bertforge` entry point does (the allocator's re-run, XLA's options, the collector), with
# the profiler on around the command; XLA's operation events need host tracer level 3.
CHILD = """
import sys
from bertforge.runtime import allocator, collector, xla_options
allocator.rerun_with_tuned_allocator(sys.argv[2])
xla_options.set_xla_flags(sys.argv[2])
collector.for_command()
import jax
from bertforge.cli import main
options = jax.profiler.ProfileOptions()
options.host_tracer_level, options.python_tracer_level = 3, 0
jax.profiler.start_trace(sys.argv[1], profiler_options=options)
try:
    main(sys.argv[2:])
finally:
    jax.profiler.stop_trace()
"""
SKIPPED = 2  # executions left out: the first carries the allocator's first touches of every buffer
KINDS = (
    "products: dense layers",
    "products: attention (batched)",
    "products dispatched asynchronously (their events: the dispatch)",
    "library fusions without a product (norm statistics, softmax)",
    "GELU (erf)",
    "copies and transposes",
    "materialised broadcasts",
    "other element-wise fusions",
)
COLOURS = ("tab:blue", "tab:cyan", "tab:gray", "tab:purple", "tab:olive", "tab:orange", "tab:red", "tab:green")


def run_profiled(command: list[str], module: str, work: Path) -> tuple[Path, Path]:
    """Run `bertforge <command>` under the profiler -> (the trace's json.gz, the module's optimised HLO text). The
    command's --out must be a new folder: a finished run there is reported, not run again."""
    env = dict(os.environ, BERTFORGE_COMPILE_CACHE=str(work / "cache"))
    env["XLA_FLAGS"] = " ".join([
        env.get("XLA_FLAGS", ""), "--xla_cpu_enable_xprof_traceme=true", f"--xla_dump_to={work / 'hlo'}",
        "--xla_dump_hlo_as_text", f"--xla_dump_hlo_module_re={re.escape(module)}",
    ]).strip()  # fmt: skip
    subprocess.run([sys.executable, "-c", CHILD, str(work / "trace"), *command], env=env, check=True)
    trace, hlo = found(work, module)
    if trace is None:
        raise SystemExit(f"no trace or no optimised HLO of {module} under {work} (was --out a new folder?)")
    return trace, hlo


def found(work: Path, module: str) -> tuple[Path | None, Path | None]:
    traces = glob.glob(str(work / "trace" / "**" / "*.trace.json.gz"), recursive=True)
    hlos = sorted(glob.glob(str(work / "hlo" / f"*.{module}.cpu_after_optimizations.txt")))
    return (Path(traces[0]), Path(hlos[-1])) if traces and hlos else (None, None)


# ------------------------------------------------------------------------------------------------------ the HLO
def _computations(text: str) -> dict[str, dict]:
    """HLO text -> {computation: {"shapes": {instruction: dims}, "ops": [(name, opcode, rest of the line)]}}."""
    comps: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?%(\S+) .*\{$", line)
        if head:
            current = comps.setdefault(head.group(1), {"shapes": {}, "ops": [], "entry": line.startswith("ENTRY")})
            continue
        m = re.match(r"\s+(?:ROOT )?%(\S+) = \w+\[([\d,]*)\]\S* ([\w-]+)\((.*)", line)
        if current is None or not m:
            continue
        name, dims, opcode, rest = m.groups()
        current["shapes"][name] = [int(x) for x in dims.split(",") if x]
        current["ops"].append((name, opcode, rest))
    return comps


def _dot_flops(comp: dict, rest: str, out: list[int]) -> tuple[int, bool]:
    """One dot's FLOPs (2 x output elements x contracted size) and whether it has batch dimensions."""
    lhs = re.findall(r"%([\w.\-]+)", rest)[0]
    if lhs not in comp["shapes"]:  # a tuple's element: not a product of the layers
        return 0, False
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest).group(1)
    k = math.prod(comp["shapes"][lhs][int(i)] for i in contracting.split(",") if i)
    return 2 * math.prod(out) * k, "lhs_batch_dims" in rest


def operations(text: str) -> dict[str, dict]:
    """The entry computation's operations -> {name: {"flops", "batched", "opcodes" (inside a fusion), "dims"}}."""
    comps = _computations(text)
    entry = next(c for c in comps.values() if c["entry"])
    found = {}
    for name, opcode, rest in entry["ops"]:
        called = re.search(r"calls=%([\w.\-]+)", rest)
        body = comps.get(called.group(1)) if called else None
        inner = body["ops"] if body else [(name, opcode, rest)]
        where = body or entry
        flops, batched = 0, False
        for inner_name, inner_op, inner_rest in inner:
            if inner_op == "dot":
                f, b = _dot_flops(where, inner_rest, where["shapes"][inner_name])
                flops, batched = flops + f, batched or b
        opcodes = {op for _, op, _ in inner} - {"parameter"}
        found[name] = {"flops": flops, "batched": batched, "opcodes": opcodes, "dims": entry["shapes"][name],
                       "fused": body is not None}  # fmt: skip
    return found


def kind_of(name: str, op: dict, asynchronous: bool) -> str:
    if op["flops"]:
        if asynchronous:
            return KINDS[2]
        return KINDS[1] if op["batched"] else KINDS[0]
    if name.startswith("ynn_fusion"):
        return KINDS[3]
    if "erf" in name:
        return KINDS[4]
    if name.startswith(("transpose", "copy")):
        return KINDS[5]
    if name.startswith("wrapped_broadcast"):
        return KINDS[6]
    return KINDS[7]


# ---------------------------------------------------------------------------------------------------- the trace
def executions(trace: dict | list, module: str) -> tuple[dict[str, list[dict]], dict[str, list[float]]]:
    """The trace's operation events of `module` by execution (XLA's run id), in the order they ran, and the times
    at which asynchronous operations ended (XLA's `end: <operation>` events), by operation."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    runs: dict[str, list[dict]] = collections.defaultdict(list)
    ends: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        args = e.get("args", {})
        if e.get("ph") == "X" and args.get("hlo_module") == module and "hlo_op" in args:
            runs[args["run_id"]].append(e)
        elif e.get("ph") == "X" and e.get("name", "").startswith("end: "):
            ends[e["name"][5:]].append(e["ts"])
    ordered = dict(sorted(runs.items(), key=lambda kv: min(e["ts"] for e in kv[1])))
    return ordered, {name: sorted(ts) for name, ts in ends.items()}


def per_execution(runs: dict[str, list[dict]], ends: dict[str, list[float]], ops: dict[str, dict]) -> tuple:
    """-> ({operation: median ms of its events per execution}, the executions' median wall, busy and summed ms,
    the products XLA dispatches asynchronously: unfused dots whose `end:` event, before the next execution starts,
    comes later after their event than the event lasts (a fusion's end also waits behind other work, but its
    event holds its work))."""
    all_runs = list(runs.values())
    starts = [min(e["ts"] for e in events) for events in all_runs[1:]] + [math.inf]
    first = SKIPPED if len(all_runs) > SKIPPED else 0
    late: dict[str, list[float]] = collections.defaultdict(list)
    times: dict[str, list[float]] = collections.defaultdict(list)
    walls, busy, summed = [], [], []
    for events, until in zip(all_runs[first:], starts[first:], strict=True):
        per_run: dict[str, float] = collections.Counter()
        for e in events:
            name, stop = e["args"]["hlo_op"], e["ts"] + e["dur"]
            per_run[name] += e["dur"] / 1e3
            done = ends.get(name, [])
            i = bisect.bisect_left(done, stop)
            late[name].append((done[i] - stop) / 1e3 if i < len(done) and done[i] < until else 0.0)
        for name, ms in per_run.items():
            times[name].append(ms)
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in events]
        walls.append((max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3)
        busy.append(busy_us(events) / 1e3)
        summed.append(sum(per_run.values()))
    kept = len(walls)
    medians = {name: statistics.median(ms + [0.0] * (kept - len(ms))) for name, ms in times.items()}
    unfused = {name for name, op in ops.items() if op["flops"] and not op["fused"]}
    asynchronous = {name for name in unfused & set(late) if statistics.median(late[name]) > medians[name]}
    window = {"executions": kept, "wall_ms": statistics.median(walls), "busy_ms": statistics.median(busy),
              "summed_ms": statistics.median(summed)}  # fmt: skip
    return medians, window, asynchronous


def by_kind(medians: dict[str, float], ops: dict[str, dict], asynchronous: set[str]) -> list[dict]:
    rows = {kind: {"kind": kind, "ms": 0.0, "gflop": 0.0, "operations": 0} for kind in KINDS}
    for name, ms in medians.items():
        op = ops.get(name, {"flops": 0, "batched": False, "opcodes": set(), "dims": []})
        row = rows[kind_of(name, op, name in asynchronous)]
        row["ms"] += ms
        row["gflop"] += op["flops"] / 1e9
        row["operations"] += 1
    return [r for r in rows.values() if r["operations"]]


def top_operations(medians: dict[str, float], ops: dict[str, dict], asynchronous: set[str], n: int) -> list[dict]:
    rows = []
    for name, ms in sorted(medians.items(), key=lambda kv: -kv[1])[:n]:
        op = ops.get(name, {"flops": 0, "batched": False, "opcodes": set(), "dims": []})
        rows.append({"operation": name, "kind": kind_of(name, op, name in asynchronous), "ms": ms,
                     "gflop": op["flops"] / 1e9, "output": "x".join(map(str, op["dims"])),
                     "inside": ", ".join(sorted(op["opcodes"]))})  # fmt: skip
    return rows


# --------------------------------------------------------------------------------------------------- the report
def _rate(gflop: float, ms: float) -> str:
    return f"{gflop / ms * 1e3:.0f}" if gflop and ms > 0.05 else "-"


def tables(kinds: list[dict], top: list[dict], window: dict[str, float]) -> str:
    total = sum(r["ms"] for r in kinds)
    flops = sum(r["gflop"] for r in kinds)
    lines = [
        "| kind | operations | ms per execution | share of the summed time | GFLOP | GFLOP/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in kinds:
        rate = "-" if r["kind"] == KINDS[2] else _rate(r["gflop"], r["ms"])
        lines.append(f"| {r['kind']} | {r['operations']} | {r['ms']:.1f} | {r['ms'] / total:.0%} | "
                     f"{r['gflop']:.1f} | {rate} |")  # fmt: skip
    lines.append(f"| **all** | {sum(r['operations'] for r in kinds)} | {total:.1f} | 100% | {flops:.1f} | - |")
    lines += ["", f"Executions measured: {window['executions']}; an execution's wall time (first operation's start to "
              f"the last's end) {window['wall_ms']:.0f} ms, at least one operation running {window['busy_ms']:.0f} ms, "
              f"the operations' times summed {window['summed_ms']:.0f} ms (the excess over the busy time: operations "
              f"that ran side by side), {flops / window['wall_ms'] * 1e3:.0f} GFLOP/s over the wall time. The work "
              "of a product dispatched asynchronously runs on the cores beside the operations that follow, and its "
              "time is counted in theirs. Medians over the executions.", "",
              "| operation | kind | output | inside | ms | GFLOP/s |", "|---|---|---|---|---|---|"]  # fmt: skip
    for r in top:
        lines.append(f"| {r['operation']} | {r['kind']} | {r['output']} | {r['inside']} | {r['ms']:.1f} | "
                     f"{_rate(r['gflop'], r['ms'])} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="cpu_step_profile", help="results name under benchmarks/results")
    p.add_argument("--module", default="jit_gradients", help="the XLA program to profile (its module name)")
    p.add_argument("--top", type=int, default=15, help="operations listed one by one")
    p.add_argument("--work", help="keep the trace and HLO here; where it holds them already, they are read again")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then a bertforge command, e.g. finetune ...")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the bertforge command after --")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        trace, hlo = found(work, args.module) if args.work and (work / "trace").exists() else (None, None)
        if trace is None:
            trace, hlo = run_profiled(command, args.module, work)
        ops = operations(hlo.read_text())
        runs, ends = executions(load_trace(trace.parent), args.module)
    if not runs:
        raise SystemExit(f"the trace has no operation of {args.module}")
    medians, window, asynchronous = per_execution(runs, ends, ops)
    kinds = by_kind(medians, ops, asynchronous)
    top = top_operations(medians, ops, asynchronous, args.top)
    title = (f"Where {args.module}'s time goes: `bertforge {' '.join(command[:3])} ...`, {window['executions']} "
             f"executions, {os.cpu_count()} CPU cores ({cpu_model()})")  # fmt: skip
    bars = [(r["kind"], r["ms"], COLOURS[KINDS.index(r["kind"])]) for r in kinds]
    save(args.name, title, tables(kinds, top, window), [{"window": window, "kinds": kinds, "top": top}], bars,
         "ms per execution (median)")  # fmt: skip


if __name__ == "__main__":
    main()
