"""The docs cannot drift from the code: every `bertforge ...` command in README.md and docs/ parses against the
current command line (its subcommands, flags, choices and config keys), and every relative link and anchor resolves.

A command in a shell code block is parsed whole (its required flags included); one named in running text, as
`bertforge evaluate --model RUN`, is parsed with the required flags left out."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from bertforge.cli import _named, build_parser, command_parsers
from bertforge.config import load_config
from bertforge.errors import UserError
from bertforge.flags import build_config, passed_overrides
from bertforge.tasks.finetune import FinetuneConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^\s*```(\S*)")
SHELL = {"bash", "sh", "shell", "console"}
SUBSTITUTION = re.compile(r"\$\((?:[^()]|\([^()]*\))*\)")  # $(...), one level of parentheses inside
VARIABLE = re.compile(r"\$\{?\w+\}?")


def shell_lines(text: str) -> list[tuple[int, str, bool]]:
    """(line number, command line, whether whole) for each line of a shell block (continuations joined) and each
    code span of the running text."""
    found, fence, held, start = [], None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            fence = None if fence is not None else m.group(1)
            continue
        if fence is None:
            found += [(number, span, False) for span in re.findall(r"`([^`\n]+)`", line)]
        elif fence in SHELL:
            start = start if held else number
            held += line.rstrip()[:-1] + " " if line.rstrip().endswith("\\") else line
            if not line.rstrip().endswith("\\"):
                found.append((start, held, True))
                held = ""
    return found


def bertforge_argvs(line: str) -> list[list[str]]:
    """The arguments of each `bertforge` command of a shell line (variables and substitutions as placeholders)."""
    line = VARIABLE.sub("1", SUBSTITUTION.sub("MODEL", line))
    argvs = []
    for part in re.split(r"&&|\|\||;|\|", line):
        try:
            words = shlex.split(part, comments=True)
        except ValueError:  # an unclosed quote: running text, not a command
            continue
        while words and re.fullmatch(r"\w+=\S*", words[0]):  # VAR=value before the command
            words = words[1:]
        if len(words) > 1 and words[0].rsplit("/", 1)[-1] == "bertforge":  # not the name alone
            argvs.append(words[1:])
    return argvs


def sketched(argv: list[str]) -> list[str]:
    """`...` as a flag's value becomes a placeholder value; elsewhere it stands for flags left out, and goes."""
    out = []
    for word in argv:
        if word != "...":
            out.append(word)
        elif out and out[-1].startswith("--") and "=" not in out[-1]:
            out.append("X")
    return out


def commands() -> list[tuple[str, list[str], bool]]:
    """(where, arguments, whether whole) of every command of the docs; one with `...` in place of values is a
    sketch, checked as running text is."""
    return [
        (f"{path.relative_to(ROOT)}:{number}", sketched(argv), whole and "..." not in argv)
        for path in DOCS
        for number, line, whole in shell_lines(path.read_text(encoding="utf-8"))
        for argv in bertforge_argvs(line)
    ]


def relax(parser: argparse.ArgumentParser) -> None:
    """No flag or positional argument of any command required (the command's name still is)."""
    for command in command_parsers(parser).values():
        for action in command._actions:
            action.required = False
            if not action.option_strings and action.nargs is None:
                action.nargs = "?"


def check(argv: list[str], whole: bool) -> None:
    """Parse as the command does: its flags, then its config (a YAML command's keys too); running text's without
    the required flags, and without a config file it does not name."""
    parser = build_parser(_named(argv))
    if not whole:
        relax(parser)
    args, extra = parser.parse_known_args(argv)
    if args.stage.remainder:
        return  # the rest belongs to the command it runs, itself a command of the docs where it is one
    if args.stage.passes:  # fine-tuning's overrides, for every task of a suite: keys of its config
        passed, extra = passed_overrides(extra)
        load_config(FinetuneConfig, None, passed)
    if whole:
        build_config(args, extra)
    elif args.stage.yaml:
        if getattr(args, "config", None) and not (ROOT / args.config).is_file():
            args.config = None
        build_config(args, extra)
    elif extra:
        raise UserError(f"unrecognized arguments: {' '.join(extra)}")


COMMANDS = commands()


def test_the_docs_hold_commands():
    assert len(COMMANDS) > 50 and any(whole for _, _, whole in COMMANDS)


@pytest.mark.parametrize(("where", "argv", "whole"), COMMANDS, ids=[w for w, _, _ in COMMANDS])
def test_each_command_in_the_docs_parses(where, argv, whole):
    try:
        check(argv, whole)
    except SystemExit as e:  # --help, --version
        assert e.code == 0, f"{where}: bertforge {' '.join(argv)}: exit {e.code}"
    except UserError as e:
        pytest.fail(f"{where}: bertforge {' '.join(argv)}: {e}")


def test_a_made_up_flag_fails():
    with pytest.raises(UserError, match="made-up"):
        check(["finetune", "--out", "x", "--made-up", "1"], whole=True)
    with pytest.raises(UserError):
        check(["finetune", "--train.made_up=1"], whole=False)
    with pytest.raises(UserError):
        check(["tokenizer", "train", "--type", "made-up"], whole=False)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str, spans: bool = False) -> str:
    """The text outside code blocks, and outside code spans unless `spans`."""
    kept, fence = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fence = not fence
        elif not fence:
            kept.append(line if spans else re.sub(r"`[^`\n]*`", "", line))
    return "\n".join(kept)


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file as GitHub makes them from its headings (lower case, punctuation dropped,
    spaces as hyphens, a repeated one numbered), and its explicit <a id/name>."""
    text = path.read_text(encoding="utf-8")
    found, seen = set(), {}
    for line in prose(text, spans=True).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))  # a link's text
        slug = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found | set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", text))


def links() -> list[tuple[str, str]]:
    return [
        (f"{path.relative_to(ROOT)}", target)
        for path in DOCS
        for target in LINK.findall(prose(path.read_text(encoding="utf-8")))
        if not re.match(r"[a-z]+:", target)  # https:, mailto:
    ]


@pytest.mark.parametrize(("where", "target"), links())
def test_each_relative_link_and_anchor_resolves(where, target):
    source = ROOT / where
    name, _, anchor = target.partition("#")
    path = (source.parent / name).resolve() if name else source
    assert path.exists(), f"{where}: {target}: no such file"
    if anchor:
        assert path.suffix == ".md", f"{where}: {target}: an anchor into a file that is not markdown"
        assert anchor in anchors(path), f"{where}: {target}: {path.name} has no heading with that anchor"


def test_a_broken_anchor_and_a_missing_file_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title, with punctuation\n\n## Results (2026)\n\n## Results (2026)\n### `--flag` [b](x.md)\n")
    assert anchors(page) == {"a-title-with-punctuation", "results-2026", "results-2026-1", "--flag-b"}
    with pytest.raises(AssertionError, match="no heading"):
        test_each_relative_link_and_anchor_resolves("README.md", "docs/launch.md#no-such-heading")
    with pytest.raises(AssertionError, match="no such file"):
        test_each_relative_link_and_anchor_resolves("README.md", "docs/no-such-page.md")


def test_the_command_line_reference_is_what_the_code_gives():
    """docs/cli.md is written from the command line (scripts/cli_reference.py); a flag added, renamed or described
    anew without writing it again fails here."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    assert (ROOT / "docs" / "cli.md").read_text(encoding="utf-8") == module.page(), (
        "docs/cli.md is not what the command line gives: run .venv/bin/python scripts/cli_reference.py"
    )
