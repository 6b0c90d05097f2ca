"""The results index (benchmarks/results/index.jsonl) and the tables rendered from it: every line has the fields a
table needs, and the README's results table is what benchmarks/report.py renders from the index, not typed."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"


def _benchmark(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def test_every_line_of_the_index_has_the_fields_tables_are_drawn_from():
    index = _benchmark("results_index")
    lines = index.read()
    assert lines, "the results index is empty"
    for number, entry in enumerate(lines, 1):
        missing = [k for k in index.REQUIRED if k not in entry]
        assert not missing, f"index.jsonl line {number} lacks {missing}"
        assert entry["cache"] in ("cold", "warm"), number
        assert isinstance(entry["seeds"], list) and entry["seeds"], number
        assert entry["wall_s"] is None or entry["wall_s"] > 0, number


def test_the_results_tables_of_the_readme_and_the_results_page_are_what_the_index_renders():
    report, index = _benchmark("report"), _benchmark("results_index")
    pages = report.pages(index.read())
    assert len(report.page_benchmarks(pages[ROOT / "docs/benchmarks.md"])) >= 6
    for page, new in pages.items():
        text = page.read_text(encoding="utf-8")
        assert report.END in text, page
        assert new == text, (
            f"{page.name}'s results table differs from what the index renders: run .venv/bin/python "
            "benchmarks/report.py"
        )


def test_a_table_edited_by_hand_is_told_apart():
    report, index = _benchmark("report"), _benchmark("results_index")
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    edited = readme.replace(report.END, "| a task | a machine | cold | Trainer | 10 s | 20 s | 0.50x |\n" + report.END)
    assert report.rendered(edited, report.render_readme(index.read())) == readme != edited


def run(benchmark: str, recipe: str, machine: str, date: str, cache: str, systems: dict) -> list[dict]:
    """The lines of one run: systems maps (system, variant) to (wall_s, value)."""
    return [{"benchmark": benchmark, "recipe": recipe, "run": f"{machine}-{date}-{cache}", "commit": "abc",
             "date": date, "machine": machine, "system": s, "variant": v, "cache": cache, "seeds": [0, 1, 2],
             "wall_s": w, "metric": "accuracy", "value": q} for (s, v), (w, q) in systems.items()]  # fmt: skip


def test_the_table_takes_each_machines_latest_first_run_and_the_faster_reference():
    report = _benchmark("report")
    zen3, xeon = "AMD EPYC, family 25 model 1, 2 cores", "Intel Xeon, 2 cores"
    trainer = "transformers Trainer (PyTorch)"
    ours, shipped, tuned = ("bertforge", "float32"), (trainer, "shipped"), (trainer, "tuned")
    lines = [
        *run("b", "r", zen3, "2026-12-01", "cold", {ours: (40, 0.6), shipped: (50, 0.6)}),
        *run("b", "r", zen3, "2026-12-07", "cold", {ours: (30, 0.63), shipped: (52, 0.62), tuned: (31, 0.61)}),
        *run("b", "r", zen3, "2026-12-07", "warm", {ours: (25, 0.63), tuned: (30, 0.6)}),
        *run("b", "r", xeon, "2026-12-02", "cold", {ours: (33, 0.62), shipped: (66, 0.6)}),
        *run("b", "other", xeon, "2026-12-09", "cold", {ours: (1, 0.1), shipped: (2, 0.1)}),
    ]
    table = report.render_table(lines, (("b", "r", "the task"),)).splitlines()
    assert len(table) == 4  # a header, its rule, a row per machine
    zen3_row = next(r for r in table if "Zen 3" in r)
    cells = [c.strip() for c in zen3_row.strip("|").split("|")]
    assert cells[1:7] == ["AMD EPYC Zen 3, 2 cores", "cold", f"{trainer}, tuned", "30 s", "31 s", "0.97x"]
    assert cells[8:10] == ["0.6300", "0.6100"] and cells[-1] == "2026-12-07, abc"
    xeon_row = next(r for r in table if "Xeon" in r)
    assert "| 0.50x |" in xeon_row and f"{trainer}, shipped" in xeon_row


def test_a_suites_scoreboards_are_rendered_from_the_lines_of_its_latest_run():
    report = _benchmark("report")
    zen3, trainer = "AMD EPYC, family 25 model 1, 2 cores", "transformers Trainer (PyTorch)"
    board = lambda score, mean: {"average": score, "tasks": {"jsts": {  # noqa: E731
        "name": "JSTS", "metric": "pearson", "mean": mean, "std": 1.5, "score": score}}}  # fmt: skip
    old = run("s", "r", zen3, "2026-12-01", "cold", {("bertforge", "float32"): (9, 1), (trainer, "tuned"): (9, 1)})
    new = run("s", "r", zen3, "2026-12-07", "cold", {("bertforge", "float32"): (30, 70), (trainer, "tuned"): (40, 69)})
    for line, scores in zip(new, ((70.25, 71.0), (69.5, 70.0)), strict=True):
        line["scoreboard"] = board(*scores)
    table = report.render_scoreboards(old + new, "s").splitlines()
    where = "| r | AMD EPYC Zen 3, 2 cores |"
    assert table[2:] == [f"{where} JSTS | 70.25 | pearson 71.00 ± 1.50 | 69.50 | pearson 70.00 ± 1.50 |",
                         f"{where} average | 70.25 | | 69.50 | |"]  # fmt: skip
    page = "a\n<!-- scoreboards of s: rendered by benchmarks/report.py; do not edit -->\nold\n<!-- results: end -->\n"
    assert report.scoreboards(page) == ["s"]


def test_speeds_are_rendered_from_each_recipes_latest_untimed_line_per_machine():
    report = _benchmark("report")
    zen3, xeon = "AMD EPYC, family 25 model 1, 2 cores", "Intel Xeon, 2 cores"
    speed = lambda machine, date, value: {**run("s", "phase a", machine, date, "warm", {("bertforge", "f32"): (  # noqa: E731
        None, value)})[0], "metric": "tokens_per_s"}  # fmt: skip
    timed = run("s", "quality", zen3, "2026-12-07", "cold", {("bertforge", "f32"): (30, 0.5)})
    table = report.render_speeds([speed(zen3, "2026-12-01", 900.0), speed(zen3, "2026-12-07", 2296.5),
                                  speed(xeon, "2026-12-02", 1200.0), *timed], "s").splitlines()  # fmt: skip
    rows = ["| phase a | AMD EPYC Zen 3, 2 cores | f32 | tokens_per_s | 2,296 | 3 | 2026-12-07, abc |",
            "| phase a | Intel Xeon, 2 cores | f32 | tokens_per_s | 1,200 | 3 | 2026-12-02, abc |"]  # fmt: skip
    assert table[2:] == rows
    page = "a\n<!-- speeds of s: rendered by benchmarks/report.py; do not edit -->\nold\n<!-- results: end -->\n"
    assert report.speed_tables(page) == ["s"]


def test_the_readme_names_the_machine_date_and_commit_in_a_caption_and_holds_at_most_eight_rows():
    report, index = _benchmark("report"), _benchmark("results_index")
    zen3, trainer = "AMD EPYC, family 25 model 1, 2 cores", "transformers Trainer (PyTorch)"
    lines = run(
        "b", "r", zen3, "2026-12-07", "cold", {("bertforge", "float32"): (30, 0.63), (trainer, "tuned"): (40, 0.6)}
    )
    text = report.render_readme(lines, (("b", "r", "the task"),)).splitlines()
    assert (
        text[0]
        == "AMD EPYC Zen 3, 2 cores; first runs (compile cache empty); medians over the seeds; 2026-12-07; commit abc:"
    )
    assert text[4].split("|")[1:6] == [" the task ", f" {trainer}, tuned ", " 30 s ", " 40 s ", " 0.75x "]
    rendered = report.render_readme(index.read()).splitlines()
    assert sum(r.startswith("| ") and not r.startswith("| task ") for r in rendered) <= 8


@pytest.mark.parametrize("bad", ['{"benchmark": "b"', "not json"])
def test_a_damaged_index_line_is_named(tmp_path, bad):
    index = _benchmark("results_index")
    path = tmp_path / "index.jsonl"
    path.write_text(json.dumps({"benchmark": "a"}) + "\n" + bad + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"index.jsonl:2: not a JSON line"):
        index.read(path)


def test_appended_lines_carry_the_run_commit_and_date_and_refuse_missing_fields(tmp_path):
    index = _benchmark("results_index")
    path = tmp_path / "index.jsonl"
    line = index.line("b", "r", "bertforge", "float32", "cold", "accuracy",
                      [{"seed": 0, "wall_s": 3.0, "value": 0.5}, {"seed": 1, "wall_s": 5.0, "value": 0.7},
                       {"seed": 2, "wall_s": 4.0, "value": 0.6}], machine="m")  # fmt: skip
    index.append([line, {**line, "system": "x"}], path)
    first, second = index.read(path)
    assert first["run"] == second["run"] and first["commit"] and first["date"]
    assert (first["wall_s"], first["value"], first["seeds"]) == (4.0, 0.6, [0, 1, 2])
    with pytest.raises(ValueError, match="lacks metric"):
        index.append([{k: v for k, v in line.items() if k != "metric"}], path)


def test_the_cpu_is_named_by_its_model_family_and_cores():
    index = _benchmark("results_index")
    cpuinfo = "processor\t: 0\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC 9B14\n\nprocessor\t: 1\n"
    assert index.cpu_machine(cpuinfo) == "AMD EPYC 9B14, family 25 model 17, 2 cores"
    assert _benchmark("report").machine_name(index.cpu_machine(cpuinfo)) == "AMD EPYC 9B14 Zen 4, 2 cores"
