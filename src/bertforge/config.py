"""YAML + dotted overrides -> frozen dataclasses, validated at load.

Every stage owns a frozen dataclass; this module turns a YAML file and `--a.b=value` overrides into one, naming
the exact key when something is unknown or of the wrong type.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from bertforge.errors import UserError

T = TypeVar("T")


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


# Types taken as they are once checked: (check, what the error says was expected). A bool is not an integer here.
_PLAIN: dict[type, tuple[Any, str]] = {
    bool: (lambda v: isinstance(v, bool), "true or false"),
    int: (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    str: (lambda v: isinstance(v, str), "a string"),
}


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except UserError as e:
                errors.append(e)
        raise UserError(f"config key '{key}': expected {_type_name(tp)}, got {value!r}")
    if origin is typing.Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise UserError(f"config key '{key}': {value!r} is not one of {choices}")
        return value
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if origin in (tuple, list) or tp in (tuple, list):
        if isinstance(value, str) and args and args[0] is str:
            value = [value]  # `--hub.language=ja`: one item of a list of strings
        if not isinstance(value, Sequence) or isinstance(value, str):
            raise UserError(f"config key '{key}': expected a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise UserError(f"config key '{key}': expected a mapping, got {value!r}")
        return dict(value)
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        # A number where text is meant (`--folds.run=0`, a column named 2020): YAML read it as a number.
        return str(value)
    if tp in _PLAIN:
        accepts, expected = _PLAIN[tp]
        if not accepts(value):
            raise UserError(f"config key '{key}': expected {expected}, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads 1e-3 (no dot) as a string; take it as the number it is meant to be.
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"config key '{key}': expected a number, got {value!r}")
        return float(value)
    raise TypeError(f"config type {tp!r} of '{key}' is not supported")  # a programming error, not a user's


def _default_changes(field: dataclasses.Field, tp: Any, given: Mapping[str, Any]) -> dict[str, Any]:
    """Where the default of a section differs from its class's own defaults (fine-tuning's AdamW beta2 and eps,
    pretraining's `mini` model): a section given in part keeps those values under the keys it sets. A `preset`
    in the section replaces the default altogether."""
    if "preset" in given:
        return {}
    factory = field.default_factory
    default = factory() if factory is not dataclasses.MISSING else field.default
    if not dataclasses.is_dataclass(default):
        return {}
    plain = to_dict(tp())
    return {k: v for k, v in to_dict(default).items() if k in plain and plain[k] != v}


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Build dataclass `cls` from a mapping; unknown keys and wrong types are UserErrors naming the key.

    A section (a field that is itself a dataclass) given in part starts from that field's default, not from its
    class's: `optim: {lr: 1e-4}` in a fine-tuning config keeps fine-tuning's other optimizer defaults."""
    if not isinstance(data, Mapping):
        raise UserError(f"config key '{where or '<root>'}': expected a mapping, got {data!r}")
    resolve = getattr(cls, "resolve_config_dict", None)
    if resolve is not None:
        data = resolve(dict(data), where)
    hints = typing.get_type_hints(cls)
    data = dict(data)
    for f in dataclasses.fields(cls):
        given = data.get(f.name)
        if f.init and isinstance(given, Mapping) and dataclasses.is_dataclass(hints[f.name]):
            data[f.name] = {**_default_changes(f, hints[f.name], given), **given}
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    for key in data:
        if key not in fields:
            hint = difflib.get_close_matches(str(key), sorted(fields), n=1)
            suggestion = f" (did you mean '{_join(where, hint[0])}'?)" if hint else ""
            raise UserError(f"unknown config key '{_join(where, str(key))}'{suggestion}")
    kwargs = {k: _coerce(hints[k], v, _join(where, k)) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field left out
        raise UserError(f"config '{where or '<root>'}': {e}") from None
    except ValueError as e:  # __post_init__ validation
        raise UserError(f"config '{where}': {e}" if where else str(e)) from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The plain-data form of a config, as it would be written to YAML or JSON."""

    def plain(v: Any) -> Any:
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(dataclasses.asdict(cfg))


def parse_value(raw: str) -> Any:
    """An override's value as a YAML scalar (`null`, `true`, `[a, b]`, `3e-4`); text that is not YAML stays text."""
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def parse_overrides(args: Sequence[str]) -> dict[str, Any]:
    """`--a.b=1 --c x` -> {'a': {'b': 1}, 'c': 'x'}; values are parsed as YAML scalars."""
    out: dict[str, Any] = {}
    i = 0
    args = list(args)
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise UserError(f"unexpected argument '{arg}' (overrides look like --section.key=value)")
        body = arg[2:]
        if "=" in body:
            key, raw = body.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            key, raw = body, args[i + 1]
            i += 1
        else:
            raise UserError(f"override '{arg}' has no value (write --{body}=VALUE)")
        value = parse_value(raw)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"override '--{key}' conflicts with an earlier one")
        node[parts[-1]] = value
        i += 1
    return out


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """`extra`'s keys over `base`'s, sections merged key by key. A key given as a value on one side and as a
    section on the other (`--model DIR` with `--model.attention=xla`) is a mistake, not an override to drop."""
    out = dict(base)
    for k, v in extra.items():
        old = out.get(k)
        if isinstance(v, Mapping) and isinstance(old, Mapping):
            out[k] = deep_merge(old, v, f"{where}{k}.")
            continue
        if old is not None and v is not None and isinstance(v, Mapping) != isinstance(old, Mapping):
            keys = ", ".join(f"{where}{k}.{s}" for s in (v if isinstance(v, Mapping) else old))
            raise UserError(f"'{where}{k}' is given both as a value and as a section with keys ({keys}); "
                            f"{where}{k} takes one or the other")  # fmt: skip
        out[k] = v
    return out


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{p}: no such config file") from None
    except UnicodeDecodeError:
        raise UserError(f"{p}: not UTF-8 text") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{p}:{where} is not valid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"{p}: the top level must be a mapping of sections")
    return data


def load_config_and_data(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    extra: Mapping[str, Any] | None = None,
) -> tuple[T, dict[str, Any]]:
    """YAML file (optional) + dotted overrides + `extra` (e.g. CLI flags) -> validated frozen `cls`, and the merged
    plain data it was built from (for callers that must know which keys were given)."""
    data = read_yaml(path) if path else {}
    given = deep_merge(parse_overrides(overrides), extra or {})
    data = deep_merge(data, given)
    try:
        return from_dict(cls, data), data
    except UserError as e:
        key = re.match(r"config key '([^'\[]+)", str(e))
        if path and not (key and _has_key(given, key.group(1))):  # else the command line gave the value
            raise UserError(f"{path}: {e}") from None
        raise


def _has_key(data: Mapping[str, Any], dotted: str) -> bool:
    """Whether `data` holds the dotted key (`folds.run`)."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """YAML file (optional) + dotted overrides -> validated frozen `cls`."""
    return load_config_and_data(cls, path, overrides)[0]
