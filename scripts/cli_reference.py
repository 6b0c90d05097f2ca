"""docs/cli.md: every command and every flag of `bertforge`, written from the command line itself (the flags come
from the configs' fields and their comments), so that the page says what `--help` says.

    .venv/bin/python scripts/cli_reference.py           # write docs/cli.md
    .venv/bin/python scripts/cli_reference.py --check   # exit 1 when docs/cli.md is not what the code gives
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bertforge.cli import COMMANDS, build_parser, command_parsers

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _flag(action: argparse.Action) -> str:
    names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.choices:
        names += " (" + ", ".join(f"`{c}`" for c in action.choices) + ")"
    return names + (" (required)" if action.required else "")


def command_section(name: str, parser: argparse.ArgumentParser) -> list[str]:
    command = COMMANDS[name]
    lines = [f"## bertforge {name}", "", _cell(command.help) + ".", ""]
    if command.description and command.description != command.help:
        lines += [_cell(command.description), ""]
    lines += ["| flag | what it sets |", "|---|---|"]
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        lines.append(f"| {_flag(action)} | {_cell(action.help % vars(action) if action.help else '')} |")
    return [*lines, ""]


def page() -> str:
    parser = build_parser()
    parsers = command_parsers(parser)
    lines = [
        "# Command-line reference",
        "",
        "Every `bertforge` command and its flags, as each command's `--help` gives them (written by",
        "`scripts/cli_reference.py`; a test fails when this page is not what the code gives). A config field is also a",
        "flag `--section.field=value`; a command with `--config` takes a YAML file whose keys the flags override.",
        "",
        *(f"- [bertforge {name}](#bertforge-{name.replace(' ', '-')})" for name in COMMANDS),
        "",
    ]
    for name in COMMANDS:
        lines += command_section(name, parsers[name])
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md differs from what the code gives")
    args = p.parse_args(argv)
    text = page()
    if args.check:
        if PAGE.read_text(encoding="utf-8") != text:
            print(f"{PAGE}: not what the command line gives; run scripts/cli_reference.py", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
