"""Command-line flags generated from a stage's frozen config dataclass.

Every field is a flag: a top-level field `seq_len` is `--seq-len`, a field of a section is `--train.max_steps` (the
key as YAML spells it, so the flag and the `--section.key=value` override are one thing). The field's type gives the
parsing (a tuple takes several values, a bool is a switch, a Literal gives the choices), its default is the flag's
default, and its comment (at the end of its line, else just above it) is the help. Only the flags that were given
reach the config: a YAML file's value stands unless a flag overrides it.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import io
import textwrap
import tokenize
import types
import typing
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

from bertforge.config import load_config_and_data, parse_value
from bertforge.errors import UserError

GIVEN = "given_fields"  # namespace attribute: {dotted field path: value} of the flags on the command line
MISSING: Any = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class Alias:
    """A friendly flag for a field (`--data` for `data.shards`); `sep` takes a list as one value split at `sep`."""

    path: str
    sep: str | None = None


@dataclasses.dataclass(frozen=True)
class Command:
    """A subcommand: the stage's config class, whose fields are its flags, and the function that runs it."""

    help: str
    config: str  # "module:Class", imported only when the command is parsed (the task modules import JAX)
    run: Callable[[Any, argparse.Namespace], int]
    description: str | None = None
    aliases: Mapping[str, str | Alias] = dataclasses.field(default_factory=dict)
    positional: Mapping[str, str] = dataclasses.field(default_factory=dict)  # field -> metavar
    options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)  # not config fields
    yaml: bool = False  # takes --config YAML, and --section.key=value overrides of keys that have no flag
    remainder: bool = False  # the last positional takes the rest of the command line, flags and all
    passes: bool = False  # --section.key=value flags it does not know go to args.passed (suite: finetune's)

    def config_class(self) -> type:
        module, name = self.config.split(":")
        return getattr(importlib.import_module(module), name)


# What a stage's main takes besides its config: a command's own options, the same wherever they appear.
OPTIONS: dict[str, dict[str, Any]] = {
    "config": {"help": "YAML config (configs/*/); the flags and --section.key=value overrides win over it"},
    "out": {"required": True, "help": "run folder: checkpoints, metrics, logs"},
    "resume": {"default": "auto", "help": "auto (default), never, or a checkpoint folder"},
    "tokenizer": {"required": True, "help": "tokenizer folder (its vocabulary sizes the model)"},
    "json": {"action": "store_true", "help": "print JSON instead of a table"},
}


def options(*names: str, **changes: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The named OPTIONS for a command, with `changes` to an option's settings where the command needs them."""
    return {name: {**OPTIONS[name], **changes.get(name, {})} for name in names}


@dataclasses.dataclass(frozen=True)
class Field:
    path: str  # dotted: "train.max_steps"
    type: Any  # the annotation, without its `| None`
    default: Any  # MISSING when the field is required
    help: str


class Parser(argparse.ArgumentParser):
    """A mistake on the command line is the user's like any other: one line `error: ...` and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{self.prog}: {message}")

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        # Config keys are spelt out as in YAML: a prefix of one is an unknown key (named, with a suggestion, by the
        # config's loader), not an abbreviation; and `--dat` stays short for `--data` alone.
        if "." in option_string.split("=", 1)[0]:
            return []
        return [t for t in super()._get_option_tuples(option_string) if not _is_key(t[0])]


def _is_key(action: argparse.Action) -> bool:
    """Whether the flag is a section's `--section.key`."""
    return any("." in s for s in action.option_strings)


class Formatter(argparse.HelpFormatter):
    def add_usage(self, usage: str | None, actions: Any, groups: Any, prefix: str | None = None) -> None:
        # The sections' flags are listed under their section; in the usage line they would bury the command's own.
        actions = [a for a in actions if not _is_key(a)]
        super().add_usage(usage, actions, groups, prefix)


class _Store(argparse.Action):
    """Records the value under the field's path in the namespace's GIVEN dict, which alone reaches the config."""

    def __init__(self, option_strings: Sequence[str], dest: str, path: str, convert: Any = None, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.path, self.convert = path, convert

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option: Any = None):
        if self.nargs == 0:
            values = not str(option).startswith("--no-")
        if self.convert is not None:
            values = self.convert(values)
        vars(namespace).setdefault(GIVEN, {})[self.path] = values


# ------------------------------------------------------------------------------------------------------ fields
def _unwrap(tp: Any) -> Any:
    """`X | None` -> X: None is what a flag's default may be, not what a user types."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def fields_of(cls: type, default: Any = MISSING, prefix: str = "") -> Iterator[Field]:
    """Every leaf field of `cls`, sections flattened. A section's fields take the section's default, not its class's
    (pretraining's `model` defaults to the mini preset)."""
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        value = _default(f) if default is MISSING else getattr(default, f.name)
        tp = _unwrap(hints[f.name])
        if dataclasses.is_dataclass(tp):
            yield from fields_of(tp, value, f"{prefix}{f.name}.")
        else:
            yield Field(prefix + f.name, tp, value, comments.get(f.name, ""))


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Each field's comment, inherited ones included: the one at the end of its line, else the lines just above."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass is not cls:
            found.update(field_comments(klass))
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source to read (a frozen build): flags without help
        return found
    depth, line, trailing, above = 0, [], [], []
    prev = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.INDENT:
            depth += 1
        elif tok.type == tokenize.DEDENT:
            depth -= 1
        elif tok.type == tokenize.COMMENT:
            (trailing if line else above).append(tok.string.lstrip("#").strip())
        elif tok.type == tokenize.NL and not line and (prev is None or prev.type != tokenize.COMMENT):
            above = []  # a blank line: the comment above belongs to no field
        elif tok.type == tokenize.NEWLINE:
            if depth == 1 and len(line) > 1 and line[0].type == tokenize.NAME and line[1].string == ":":
                found[line[0].string] = " ".join(trailing or above)
            line, trailing, above = [], [], []
        elif tok.type != tokenize.NL:
            line.append(tok)
        prev = tok
    return found


# ------------------------------------------------------------------------------------------------------ flags
def _shown(value: Any, yaml: bool, sep: str = " ") -> str:
    """A default as the user would type it; nothing for a switch or an empty value."""
    if value is MISSING or value == "" or value == () or (not yaml and (value is None or isinstance(value, bool))):
        return ""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, tuple):
        return f"[{', '.join(map(str, value))}]" if yaml else sep.join(map(str, value))
    return str(value)


def _help(field: Field, yaml: bool, sep: str = " ", note: str = "") -> str:
    text = " ".join(t for t in (field.help, note) if t)
    shown = _shown(field.default, yaml, sep)
    if shown and "default" not in text:
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    return text.replace("%", "%%")


def _add_flag(parser: Any, field: Field, flag: str, sep: str | None = None, metavar: str = "", rest: bool = False):
    """A flag as a user types it: typed, a switch for a bool, several values (or `sep`-separated) for a tuple."""
    tp, default = field.type, field.default
    kwargs: dict[str, Any] = {"action": _Store, "path": field.path, "default": None if default is MISSING else default}
    origin = typing.get_origin(tp) or tp
    if origin in (tuple, list):
        item = (typing.get_args(tp) or (str,))[0]
        if sep is None:
            kwargs.update(nargs=argparse.REMAINDER if rest else "+", type=item)
        else:
            kwargs["convert"] = lambda value: value.split(sep)
        if rest:  # `--` only separates the rest from the command's own flags
            kwargs["convert"] = lambda value: value[1:] if value[:1] == ["--"] else value
    elif tp is bool:
        kwargs.update(nargs=0)
    elif origin is typing.Literal:
        kwargs["choices"] = typing.get_args(tp)
    elif tp in (int, float, str):
        kwargs["type"] = tp
    else:
        kwargs["type"] = parse_value
    kwargs["help"] = _help(
        field, False, sep or " ", ("(comma-separated)" if sep == "," else f"(separated by {sep!r})") if sep else ""
    )
    if metavar:
        parser.add_argument(field.path, metavar=metavar, **kwargs)
        return
    names = [flag, f"--no-{flag[2:]}"] if tp is bool and default is True else [flag]
    if "choices" not in kwargs and tp is not bool:
        kwargs["metavar"] = flag.lstrip("-").replace("-", "_").upper()
    parser.add_argument(*names, dest=field.path, required=default is MISSING, **kwargs)


def _is_list_of_sections(tp: Any) -> bool:
    return typing.get_origin(tp) in (tuple, list) and any(dataclasses.is_dataclass(a) for a in typing.get_args(tp))


def _add_override(parser: Any, field: Field) -> None:
    """A section's field as `--section.key=value`: the value is read as YAML and checked by the config's loader,
    exactly as an override of a key without a flag is."""
    origin = typing.get_origin(field.type)
    choices = typing.get_args(field.type) if origin is typing.Literal else ()
    metavar = "{" + ",".join(map(str, choices)) + "}" if choices else field.path.rsplit(".", 1)[-1].upper()
    parser.add_argument(
        f"--{field.path}",
        action=_Store,
        path=field.path,
        dest=field.path,
        type=parse_value,
        default=None if field.default is MISSING else field.default,
        metavar=metavar,
        help=_help(field, True),
    )


def add_flags(parser: argparse.ArgumentParser, command: Command) -> None:
    """The command's flags: positionals, then its top-level fields and aliases, its options, then each section's."""
    fields = list(fields_of(command.config_class()))
    by_path = {f.path: f for f in fields}
    aliases = {flag: a if isinstance(a, Alias) else Alias(a) for flag, a in command.aliases.items()}
    replaced = {a.path: flag for flag, a in aliases.items() if "." not in a.path}
    for i, (name, metavar) in enumerate(command.positional.items()):
        last = i == len(command.positional) - 1
        _add_flag(parser, by_path[name], "", metavar=metavar, rest=command.remainder and last)
    for f in fields:
        if "." not in f.path and f.path not in command.positional:
            if _is_list_of_sections(f.type):  # pretraining's phases: one YAML value, as a config file gives it
                _add_override(parser, f)
            else:
                _add_flag(parser, f, replaced.get(f.path, "--" + f.path.replace("_", "-")))
    for flag, alias in aliases.items():
        if "." in alias.path:
            _add_flag(parser, by_path[alias.path], flag, alias.sep)
    for name, kwargs in command.options.items():
        parser.add_argument(f"--{name}", **kwargs)
    groups: dict[str, Any] = {}
    for f in fields:
        if "." in f.path:
            section = f.path.rsplit(".", 1)[0]
            if section not in groups:
                groups[section] = parser.add_argument_group(section)
            _add_override(groups[section], f)
    parser.set_defaults(stage=command)


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def passed_overrides(extra: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the --section.key=value flags of `extra`, the rest): what a command that passes overrides on gives on."""
    passed = [a for a in extra if a.startswith("--") and "=" in a and "." in a.split("=", 1)[0]]
    return passed, [a for a in extra if a not in passed]


def build_config(args: argparse.Namespace, extra: Sequence[str]) -> tuple[Any, dict[str, Any]]:
    """The stage's config from the parsed flags (and, for a YAML command, its --config file and free overrides), and
    the plain data it was built from."""
    command: Command = args.stage
    cls = command.config_class()
    given = _nest(getattr(args, GIVEN, {}))
    if command.yaml:
        return load_config_and_data(cls, getattr(args, "config", None), extra, given)
    if extra:
        raise UserError(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}), given
    except ValueError as e:  # the config's own checks
        raise UserError(str(e)) from None


class Version(argparse.Action):
    """--version: prints `bertforge X.Y.Z` and exits; the version is looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from bertforge import version

        print(f"bertforge {version()}")
        parser.exit()
