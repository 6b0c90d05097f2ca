"""AdamW with decoupled weight decay (not on biases or LayerNorm), global-norm clipping, and schedules.

Schedules are functions of training progress p in [0, 1] (steps done / total, or time spent / time budget), so
the same shapes serve a step budget and Cramming's wall-clock budget. The learning rate is computed on the host
and passed into the jitted step; the step stays pure.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import optax

SCHEDULES = ("linear", "polynomial", "cosine", "constant")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    lr: float = 5e-4
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-6
    weight_decay: float = 0.01
    schedule: str = "linear"
    warmup_steps: int = 0
    warmup_fraction: float = 0.06  # used when warmup_steps is 0
    end_lr_ratio: float = 0.0  # final lr = lr * end_lr_ratio
    power: float = 1.0  # polynomial decay power (fairseq's polynomial_decay)
    clip_norm: float | None = 1.0

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ValueError(f"clip_norm must be positive or null, got {self.clip_norm}")


def learning_rate(cfg: OptimConfig, progress: float, warmup: float) -> float:
    """lr at `progress` in [0, 1], with linear warmup over the first `warmup` of progress."""
    p = min(max(progress, 0.0), 1.0)
    if warmup > 0 and p < warmup:
        return cfg.lr * p / warmup
    end = cfg.lr * cfg.end_lr_ratio
    if cfg.schedule == "constant":
        return cfg.lr
    q = (p - warmup) / (1 - warmup) if warmup < 1 else 1.0  # decay progress in [0, 1]
    if cfg.schedule == "linear":
        return end + (cfg.lr - end) * (1 - q)
    if cfg.schedule == "polynomial":
        return end + (cfg.lr - end) * (1 - q) ** cfg.power
    return end + (cfg.lr - end) * 0.5 * (1 + math.cos(math.pi * q))


def warmup_fraction(cfg: OptimConfig, total_steps: int | None) -> float:
    if cfg.warmup_steps and total_steps:
        return min(cfg.warmup_steps / total_steps, 1.0)
    return cfg.warmup_fraction


def decay_mask(params: Any) -> Any:
    """True for matrices and embeddings; biases and LayerNorm scales take no weight decay (BERT, RoBERTa)."""

    def is_decayed(path: tuple, _: Any) -> bool:
        # Leaves of an nnx.State sit under the Variable's own node: take the last name that is a parameter's.
        names = [str(getattr(p, "key", getattr(p, "name", p))) for p in path]
        names = [n for n in names if n not in ("value", "raw_value", "_raw_value")]
        return bool(names) and names[-1] in ("kernel", "embedding")

    return jax.tree_util.tree_map_with_path(is_decayed, params)


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip -> AdamW, with the learning rate an injected hyperparameter set each step."""
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    if cfg.clip_norm is None:
        return optax.chain(optax.identity(), adamw)
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)


def set_learning_rate(opt_state: Any, lr: jax.Array) -> Any:
    """The optimizer state with this step's learning rate (the state is (clip, injected adamw))."""
    clip_state, adam_state = opt_state
    hyper = dict(adam_state.hyperparams)
    hyper["learning_rate"] = lr
    return (clip_state, adam_state._replace(hyperparams=hyper))
