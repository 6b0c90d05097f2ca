"""A weighted mixture of shard folders (data.sources): a domain's text beside general text, languages at a
temperature over their sizes (mmBERT, XLM-R), corpora at chosen rates (fairseq's sampling weights).

Which rows batch k takes is a function of (seed, k) alone, as for one folder (shards.py), so a loader's state is still
just k and a resumed run reads what an unbroken one reads. Of the first n rows of the run, source s gives
round(n * W_s) - round(n * W_(s-1)) (W: the cumulative weights): within one row of n * w_s at every point, with no
sampling noise. Source s's m-th row is row m mod N_s of its own shuffled order of epoch m // N_s, so a small source
repeats epoch after epoch while a large one is never read twice before it has been read whole. A batch's rows are
then shuffled together, so that every device's slice holds every source.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from bertforge.data.shards import BatchLoader, Shards, rows_of_parts
from bertforge.errors import UserError


@dataclasses.dataclass(frozen=True)
class Source:
    path: str
    weight: float | None  # None: from the temperature over the sources' sizes
    name: str


def parse_sources(entries: Sequence[str]) -> list[Source]:
    """data.sources entries, PATH=WEIGHT or PATH (its weight from data.temperature); each named by its folder."""
    sources = []
    for entry in entries:
        path, eq, weight = str(entry).rpartition("=") if "=" in str(entry) else (str(entry), "", "")
        try:
            value = float(weight) if eq else None
        except ValueError:
            value = -1.0
        if not path or (value is not None and not (math.isfinite(value) and value > 0)):
            raise UserError(f"data.sources: {entry!r} is not PATH=WEIGHT with a positive weight, or PATH")
        name = path.rstrip("/").rsplit("/", 1)[-1]
        sources.append(Source(path, value, name))
    names = [s.name for s in sources]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"data.sources: two sources are named {twice[0]!r} (by their folders); rename one folder")
    given = {s.weight is None for s in sources}
    if len(given) > 1:
        raise UserError("data.sources: give every source a weight (PATH=WEIGHT) or none (data.temperature weighs them)")
    return sources


def mixture_weights(sizes: Sequence[int], weights: Sequence[float | None], temperature: float | None) -> np.ndarray:
    """The sources' shares of the rows, summing to 1: the weights given, or size^temperature."""
    if all(w is not None for w in weights):
        if temperature is not None:
            raise UserError("data.temperature weighs sources given without weights; these have weights")
        raw = np.asarray(weights, np.float64)
    else:
        t = 1.0 if temperature is None else temperature
        raw = np.asarray(sizes, np.float64) ** t
    return raw / raw.sum()


def rows_given(n: int, weights: np.ndarray) -> np.ndarray:
    """(S,) rows each source gives of the first n rows of the run (they sum to n)."""
    cumulative = np.floor(n * np.cumsum(weights) + 0.5).astype(np.int64)
    cumulative[-1] = n  # the float sum of the weights may fall short of 1
    return np.diff(np.concatenate([[0], cumulative]))


class MixedShards:
    """Several shard folders of one tokenizer and one sequence length, read as one: Shards' interface, their rows
    numbered one folder after another, with the mixture's weights."""

    def __init__(self, sources: list[Source], split: str, temperature: float | None = None):
        self.sources, self.split = sources, split
        self.parts = [Shards(s.path, split) for s in sources]
        first = self.parts[0]
        for part in self.parts[1:]:
            for key, what in (("tokenizer_sha256", "tokenizer"), ("seq_len", "sequence length"), ("packed", "packing")):
                if part.manifest.get(key) != first.manifest.get(key):
                    raise UserError(
                        f"data.sources: {part.root} and {first.root} differ in {what}; mix folders that one "
                        "`bertforge preprocess` setting made with one tokenizer"
                    )
        sizes = [p.num_sequences for p in self.parts]
        self.weights = mixture_weights(sizes, [s.weight for s in sources], temperature)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.root = " + ".join(p.root for p in self.parts)
        self.seq_len, self.manifest = first.seq_len, first.manifest

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def num_sequences(self) -> int:
        return int(self.offsets[-1])

    @property
    def packed(self) -> bool:
        return self.parts[0].packed

    @property
    def pad_id(self) -> int:
        return self.parts[0].pad_id

    def tokenizer(self) -> Any:
        return self.parts[0].tokenizer()

    def check_tokenizer(self, tokenizer: Any, source: str) -> None:
        for part in self.parts:
            part.check_tokenizer(tokenizer, source)

    def check_model(self, max_seq_len: int, vocab_size: int, source: str) -> None:
        for part in self.parts:
            part.check_model(max_seq_len, vocab_size, source)

    def verify(self) -> None:
        for part in self.parts:
            part.verify()

    def rows(self, indices: np.ndarray) -> np.ndarray:
        """(n,) row numbers over the folders one after another -> (n, T) int32 token ids."""
        return rows_of_parts(indices, self.offsets, self.seq_len, lambda s, rows: self.parts[s].rows(rows))

    def describe(self) -> str:
        shares = ", ".join(f"{n} {w:.1%}" for n, w in zip(self.names, self.weights, strict=True))
        return f"a mixture of {len(self.parts)} folders ({shares})"


class MixtureLoader(BatchLoader):
    """BatchLoader's global batches drawn from a MixedShards by its weights (the module's order)."""

    def __init__(self, shards: MixedShards, global_batch: int, seed: int = 0, sharding: Any = None, **kw: Any):
        super().__init__(shards, global_batch, seed=seed, sharding=sharding, **kw)  # type: ignore[arg-type]
        self.mixture = shards
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def _source_permutation(self, s: int, epoch: int) -> np.ndarray:
        if (s, epoch) not in self._perms:
            if len(self._perms) > 4 * len(self.mixture.parts):
                self._perms.clear()
            rng = np.random.default_rng([self.seed, s, epoch, 1])  # 4 numbers: never one folder's [seed, epoch]
            self._perms[(s, epoch)] = rng.permutation(self.mixture.parts[s].num_sequences)
        return self._perms[(s, epoch)]

    def global_indices(self, k: int) -> np.ndarray:
        """Row numbers (MixedShards.rows') of global batch k (B,)."""
        before = rows_given(k * self.global_batch, self.mixture.weights)
        after = rows_given((k + 1) * self.global_batch, self.mixture.weights)
        picked = []
        for s, (a, b) in enumerate(zip(before, after, strict=True)):
            m = np.arange(a, b)  # the source's m-th rows of the run
            size = self.mixture.parts[s].num_sequences
            epochs, within = np.divmod(m, size)
            for e in np.unique(epochs):
                picked.append(self._source_permutation(s, int(e))[within[epochs == e]] + self.mixture.offsets[s])
        rows = np.concatenate(picked)
        return np.random.default_rng([self.seed, k, 2]).permutation(rows)

    def tokens_by_source(self) -> dict[str, int]:
        """Tokens each source has given so far (the batches served)."""
        given = rows_given(self.step * self.global_batch, self.mixture.weights)
        return {n: int(g) * self.mixture.seq_len for n, g in zip(self.mixture.names, given, strict=True)}

    def state_dict(self) -> dict[str, Any]:
        weights = ",".join(f"{n}={w:.6g}" for n, w in zip(self.mixture.names, self.mixture.weights, strict=True))
        return {**super().state_dict(), "mixture": weights}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("mixture") != self.state_dict()["mixture"]:
            raise UserError(
                f"the saved data position was taken with the mixture {state.get('mixture') or '(one folder)'}, "
                f"this run has {self.state_dict()['mixture']}: the data order would differ"
            )
        super().load_state_dict({k: v for k, v in state.items() if k != "mixture"})


def training_shards(shards: str, sources: Sequence[str], temperature: float | None, split: str) -> Any:
    """data.shards' folder, or data.sources' mixture; one of them."""
    if bool(shards) == bool(sources):
        raise UserError("data: give data.shards (one folder, --data) or data.sources (a mixture), one of them")
    if not sources:
        if temperature is not None:
            raise UserError("data.temperature weighs the folders of data.sources; data.shards is one folder")
        return Shards(shards, split)
    return MixedShards(parse_sources(sources), split, temperature)


def loader_for(shards: Any, global_batch: int, seed: int, sharding: jax.sharding.Sharding | None = None) -> Any:
    """A BatchLoader of one folder, or a MixtureLoader of a mixture."""
    if isinstance(shards, MixedShards):
        return MixtureLoader(shards, global_batch, seed=seed, sharding=sharding)
    return BatchLoader(shards, global_batch, seed=seed, sharding=sharding)
