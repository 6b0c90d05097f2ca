"""Entity tag schemes (IO, BIO, BIOES): reading entities out of a tag sequence as conlleval does, and writing them
back in any scheme.

A tag is "O" or PREFIX-TYPE with PREFIX one of B (begins), I (inside), E (ends), S (single unit). Entities are
(type, first, last) with `last` inclusive, over whatever units the tags label (words or tokens).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

SCHEMES = ("io", "bio", "bioes")
PREFIXES = ("B", "I", "E", "S")
# The prefixes each scheme writes, in the order labels_of lists them.
_SCHEME_PREFIXES = {"io": ("I",), "bio": ("B", "I"), "bioes": ("B", "I", "E", "S")}


def tag_problem(tag: object) -> str | None:
    """Why `tag` is not a tag (a short phrase for an error message), or None when it is one."""
    if not isinstance(tag, str):
        return f"the tag {tag!r} is not a string"
    if tag == "O":
        return None
    prefix, dash, kind = tag.partition("-")
    if prefix in PREFIXES and not dash:
        return f"the tag {tag!r} has no entity type (write {prefix}-TYPE, e.g. {prefix}-PER)"
    if prefix not in PREFIXES:
        return f"the tag {tag!r} is neither O nor B-, I-, E- or S- followed by an entity type"
    if not kind.strip():
        return f"the tag {tag!r} has an empty entity type"
    return None


def _split(tag: str) -> tuple[str, str]:
    """'B-LOC' -> ('B', 'LOC'); 'O' -> ('O', '')."""
    if tag == "O":
        return "O", ""
    problem = tag_problem(tag)
    if problem is not None:
        raise ValueError(problem)
    prefix, _, kind = tag.partition("-")
    return prefix, kind


def scheme_of(tags: Iterable[str]) -> str:
    """The least scheme that writes every tag seen: 'io' when only I- and O, 'bioes' when any E- or S-, else 'bio'."""
    prefixes = {_split(t)[0] for t in tags}
    if prefixes & {"E", "S"}:
        return "bioes"
    return "bio" if "B" in prefixes else "io"


def spans_of(tags: Sequence[str]) -> list[tuple[str, int, int]]:
    """The entities of a tag sequence as (type, first, last), `last` inclusive, chunked as conlleval (and seqeval's
    default mode) chunk any mix of IO, BIO (IOB1 and IOB2) and BIOES tags."""
    spans: list[tuple[str, int, int]] = []
    prev_prefix, prev_kind = "O", ""
    for i, tag in enumerate(tags):
        prefix, kind = _split(tag)
        # A unit carries on the open entity only as I or E after B or I of the same type; any other tag ends it.
        carries_on = prefix in ("I", "E") and prev_prefix in ("B", "I") and kind == prev_kind
        if prev_prefix != "O" and not carries_on:
            spans[-1] = (prev_kind, spans[-1][1], i - 1)
        if prefix != "O" and not carries_on:
            spans.append((kind, i, i))
        prev_prefix, prev_kind = prefix, kind
    if prev_prefix != "O":
        spans[-1] = (prev_kind, spans[-1][1], len(tags) - 1)
    return spans


def tags_of(spans: Sequence[tuple[str, int, int]], n: int, scheme: str) -> list[str]:
    """`n` unit tags in `scheme` for non-overlapping (type, first, last) entities. IO cannot tell two adjacent
    entities of one type apart: they read back as one."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown tag scheme {scheme!r} (one of {', '.join(SCHEMES)})")
    tags = ["O"] * n
    for kind, first, last in sorted(spans, key=lambda s: s[1]):
        if not 0 <= first <= last < n:
            raise ValueError(f"the entity {(kind, first, last)} is not within {n} units")
        if any(t != "O" for t in tags[first : last + 1]):
            raise ValueError(f"the entity {(kind, first, last)} overlaps another")
        inside = "I" if scheme == "io" else "B"
        tags[first : last + 1] = [f"I-{kind}"] * (last - first + 1)
        tags[first] = f"{inside}-{kind}"
        if scheme == "bioes":
            tags[last] = f"E-{kind}" if last > first else f"S-{kind}"
    return tags


def convert(tags: Sequence[str], scheme: str) -> list[str]:
    """The same entities written in `scheme`."""
    return tags_of(spans_of(tags), len(tags), scheme)


def labels_of(types: Iterable[str], scheme: str) -> list[str]:
    """Every tag of `scheme` for these entity types: 'O' first, then by type, each type's prefixes in B, I, E, S
    order."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown tag scheme {scheme!r} (one of {', '.join(SCHEMES)})")
    kinds = sorted(set(types))
    if any(not k for k in kinds):
        raise ValueError("an entity type is empty")
    return ["O", *(f"{p}-{k}" for k in kinds for p in _SCHEME_PREFIXES[scheme])]
