"""Pretraining in phases (`phases:` in the config), as 2025's encoders were trained: ModernBERT's long stable
learning rate, then a context extension at a larger RoPE theta, then the decay; mmBERT's falling mask rate and
mixture temperature. Each phase runs for its steps (or tokens) with the config of the phase before (the first: the
run's) changed by the keys it names:
its data (another folder, a mixture and its weights, shards of another length), its masking, its piece of the
learning-rate schedule (over the phase's own progress: a warmup-and-stable phase then a decay phase make WSD), and a
rotary model's theta and length. The weights and the optimizer's state go on from phase to phase; a phase's step
program is compiled when it starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bertforge.config import from_dict, to_dict
from bertforge.errors import UserError

# What a phase may change: whole sections, or these keys of the model (what changes no weight's shape).
SECTIONS = ("data", "mlm", "rtd", "optim")
MODEL_KEYS = ("global_rope_theta", "local_rope_theta", "max_position_embeddings")
ROTARY = ("modernbert",)  # families whose positions are rotary: a longer context adds no weight


@dataclasses.dataclass(frozen=True)
class PhaseConfig:
    steps: int | None = None  # the phase's length in steps, or
    tokens: int | None = None  # in tokens (whole steps of train.global_batch x the phase's sequence length)
    name: str = ""  # in the logs (default: phase-N)
    data: dict[str, Any] = dataclasses.field(default_factory=dict)  # data section keys: shards, sources, temperature
    mlm: dict[str, Any] = dataclasses.field(default_factory=dict)  # the mask rate and its fractions
    rtd: dict[str, Any] = dataclasses.field(default_factory=dict)
    optim: dict[str, Any] = dataclasses.field(default_factory=dict)  # the schedule over the phase: lr, schedule, ...
    model: dict[str, Any] = dataclasses.field(default_factory=dict)  # rotary theta, max_position_embeddings

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.tokens is None):
            raise ValueError("a phase takes steps or tokens, one of them")
        if (self.steps or self.tokens or 0) < 1:
            raise ValueError("a phase's steps or tokens must be positive")
        other = sorted(set(self.model) - set(MODEL_KEYS))
        if other:
            raise ValueError(f"model.{other[0]}: a phase may change only {', '.join(MODEL_KEYS)} of the model")


@dataclasses.dataclass(frozen=True)
class Phase:
    index: int
    name: str
    cfg: Any  # the run's PretrainConfig as this phase changes it (no phases of its own)
    start: int  # global step the phase starts after
    steps: int  # of a phase given in tokens: whole steps of its shards' sequence length

    @property
    def end(self) -> int:
        return self.start + self.steps


def phase_configs(cfg: Any) -> list[tuple[str, Any, PhaseConfig]]:
    """(name, config, phase) of each phase: the config the phase before ran (the first: `cfg`) with the keys the
    phase names changed, checked as a whole. A longer context stays longer, a mixture stays until one replaces it."""
    base = to_dict(dataclasses.replace(cfg, phases=()))
    given = [k for k in ("max_steps", "max_epochs", "max_tokens", "time_budget_minutes") if base["train"].get(k)]
    if given:
        raise UserError(f"train.{given[0]}: with phases, each phase's steps or tokens are the budget")
    out, data = [], base
    for i, phase in enumerate(cfg.phases):
        name = phase.name or f"phase-{i + 1}"
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}  # the phase before's, changed
        for section in SECTIONS:
            data[section] = {**data.get(section, {}), **getattr(phase, section)}
        if phase.data.get("sources"):
            data["data"]["shards"] = ""  # a phase's mixture replaces the run's folder
        elif phase.data.get("shards"):
            data["data"]["sources"] = []
        data["model"] = {**data["model"], **phase.model}
        out.append((name, from_dict(type(cfg), data, f"phases[{i}]"), phase))
    return out


def steps_of(phase: PhaseConfig, global_batch: int, seq_len: int, where: str) -> int:
    if phase.steps is not None:
        return phase.steps
    steps = phase.tokens // (global_batch * seq_len)
    if steps < 1:
        raise UserError(f"{where}: {phase.tokens} tokens are less than one step of {global_batch} x {seq_len}")
    return steps


def local_progress(progress: float, phase: Phase) -> float:
    """The loop's progress over the run so far (step / the phase's end) as progress through the phase."""
    return (progress * phase.end - phase.start) / phase.steps


def phase_model(phase: Phase) -> dict[str, Any]:
    """The model keys a phase may change, as it runs them: a checkpoint of the phase carries them to its export."""
    return {k: getattr(phase.cfg.model, k) for k in MODEL_KEYS}
