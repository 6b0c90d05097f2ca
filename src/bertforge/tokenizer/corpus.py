"""The lines a tokenizer is trained on: streamed from every file, optionally sampled, in bounded memory.

Reading streams line by line (local, compressed or fsspec files alike), so memory holds at most the sample: a
reservoir (Vitter's Algorithm R) of `--sample-lines` lines drawn uniformly from all files with a seeded generator,
which gives the same lines, in the same order, on every run.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import unicodedata
from collections.abc import Iterable, Iterator, Sequence

from tqdm.auto import tqdm

from bertforge.data.documents import file_size, iter_documents

# Longer lines are cut into pieces of this many characters: SentencePiece skips a sentence over its byte limit
# without a word, and a lattice over a whole book costs memory for nothing.
MAX_LINE_CHARS = 32_768
# The scripts of text written without spaces between words (and Hangul: a large alphabet, as SentencePiece
# counts coverage); their characters are many, so the rarest are left to [UNK] or byte fallback.
CJK_SCRIPTS = ("CJK", "HIRAGANA", "KATAKANA", "HANGUL")


@dataclasses.dataclass
class ReadStats:
    """What the reading pass saw, filled in as it goes."""

    files: int = 0
    lines: int = 0
    bytes: int = 0

    def line(self, sampled: int | None = None) -> str:
        mb = self.bytes / 2**20
        kept = f"; {sampled:,} lines sampled" if sampled is not None and sampled < self.lines else ""
        return f"read {self.lines:,} lines ({mb:,.1f} MB) from {self.files} file(s){kept}"


def read_lines(paths: Sequence[str], stats: ReadStats, progress: bool = False) -> Iterator[str]:
    """The non-empty lines of every file, long ones cut; `stats` counts them and a bar shows the bytes read."""
    total = sum(file_size(p) for p in paths)
    bar = tqdm(total=total or None, unit="B", unit_scale=True, desc="read", disable=not progress, file=sys.stderr)
    with bar:
        for path in paths:
            stats.files += 1
            for line in iter_documents(path, doc_per_line=True):
                size = len(line.encode("utf-8")) + 1
                stats.lines += 1
                stats.bytes += size
                bar.update(size)
                yield from cut(line)


def cut(line: str, limit: int = MAX_LINE_CHARS) -> Iterator[str]:
    if len(line) <= limit:
        yield line
        return
    for i in range(0, len(line), limit):
        yield line[i : i + limit]


def reservoir(lines: Iterable[str], k: int, seed: int) -> list[str]:
    """A uniform sample of `k` lines (all of them, in order, when there are no more), the same for the same seed."""
    rng = random.Random(seed)
    kept: list[str] = []
    for n, line in enumerate(lines):
        if n < k:
            kept.append(line)
        else:
            j = rng.randrange(n + 1)
            if j < k:
                kept[j] = line
    return kept


def mostly_cjk(lines: Iterable[str]) -> bool:
    """Whether most non-space characters of `lines` are Chinese, Japanese or Korean."""
    cjk = other = 0
    for line in lines:
        for ch in line:
            if ch.isspace():
                continue
            if ord(ch) >= 0x1100 and unicodedata.name(ch, "").startswith(CJK_SCRIPTS):
                cjk += 1
            else:
                other += 1
    return cjk > other
