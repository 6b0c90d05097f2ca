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
import jax.numpy as jnp
import optax

from bertforge.train.ema import with_ema
from bertforge.train.loss_scale import with_loss_scale

SCHEDULES = ("linear", "polynomial", "cosine", "constant", "wsd")


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
    # wsd (warmup-stable-decay, ModernBERT's): lr held after the warmup, then brought to the end over this last
    # share of the budget, as 1 - sqrt (Hägele et al. 2024). Until the decay, a run's lr does not depend on its
    # budget: a run can be extended, or continued from a checkpoint of its stable phase.
    decay_fraction: float = 0.1
    clip_norm: float | None = 1.0  # gradients clipped to this global norm; null: no clipping
    layer_decay: float = 1.0  # layer-wise lr decay: layer i of L gets lr * decay^(L-1-i), embeddings decay^L
    head_lr: float | None = None  # the task head's lr (default: lr), scaled by the same schedule

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.warmup_fraction < 1:
            raise ValueError(f"warmup_fraction must be in [0, 1), got {self.warmup_fraction}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.clip_norm is not None and self.clip_norm <= 0:
            raise ValueError(f"clip_norm must be positive or null, got {self.clip_norm}")
        if not 0 < self.layer_decay <= 1:
            raise ValueError(f"layer_decay must be in (0, 1], got {self.layer_decay}")
        if self.head_lr is not None and self.head_lr <= 0:
            raise ValueError(f"head_lr must be positive or null, got {self.head_lr}")


def learning_rate(cfg: OptimConfig, progress: float, warmup: float) -> float:
    """lr at `progress` in [0, 1], with linear warmup over the first `warmup` of progress."""
    p = min(max(progress, 0.0), 1.0)
    if warmup > 0 and p < warmup:
        return cfg.lr * p / warmup
    end = cfg.lr * cfg.end_lr_ratio
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "wsd":
        start = max(1.0 - cfg.decay_fraction, warmup)  # the decay never starts inside the warmup
        if p <= start:
            return cfg.lr
        return end + (cfg.lr - end) * (1 - math.sqrt((p - start) / (1 - start)))
    q = (p - warmup) / (1 - warmup) if warmup < 1 else 1.0  # decay progress in [0, 1]
    if cfg.schedule == "linear":
        return end + (cfg.lr - end) * (1 - q)
    if cfg.schedule == "polynomial":
        return end + (cfg.lr - end) * (1 - q) ** cfg.power
    return end + (cfg.lr - end) * 0.5 * (1 + math.cos(math.pi * q))


def warmup_fraction(cfg: OptimConfig, total_steps: int | None) -> float:
    """The share of training spent warming up. Where the run's step count is known it is whole steps, the fraction's
    rounded up as transformers' Trainer rounds `warmup_ratio`: a run of a few steps (a large batch on a small set)
    then takes the Trainer's learning rate at every step, where an unrounded 0.3 of a step would lower them all."""
    if not total_steps:
        return cfg.warmup_fraction
    steps = cfg.warmup_steps or math.ceil(total_steps * cfg.warmup_fraction)
    return min(steps / total_steps, 1.0)


def _names(path: tuple) -> list[str]:
    return [str(getattr(p, "key", getattr(p, "name", p))) for p in path]


def param_names(path: tuple) -> list[str]:
    """The names along a parameter's tree path, without the Variable's own node that nnx.State leaves sit under."""
    return [n for n in _names(path) if n not in ("value", "raw_value", "_raw_value")]


def decay_mask(params: Any) -> Any:
    """True for matrices and embeddings; biases and LayerNorm scales take no weight decay (BERT, RoBERTa)."""

    def is_decayed(path: tuple, _: Any) -> bool:
        names = param_names(path)
        # delta: rtd.py's residual table; untouched: the factor of the word-embedding rows a fine-tuning run's
        # data does not use (model/used_rows.py), decayed as those rows are.
        return bool(names) and names[-1] in ("kernel", "embedding", "delta", "untouched")

    return jax.tree_util.tree_map_with_path(is_decayed, params)


def lr_multipliers(cfg: OptimConfig, params: Any, num_layers: int) -> Any:
    """Per-parameter factors on the learning rate: layer-wise decay in the encoder, head_lr / lr in the heads."""
    head = (cfg.head_lr or cfg.lr) / cfg.lr

    def factor(path: tuple, _: Any) -> float:
        names = _names(path)
        if "encoder" not in names:
            return head
        if "layers" in names:
            depth = int(names[names.index("layers") + 1])
            return cfg.layer_decay ** (num_layers - 1 - depth)
        return cfg.layer_decay**num_layers  # embeddings

    return jax.tree_util.tree_map_with_path(factor, params)


def _scale_by_tree(factors: Any) -> optax.GradientTransformation:
    # Scaling AdamW's whole update (step and decoupled decay) by m is AdamW with learning rate lr * m.
    return optax.GradientTransformation(
        lambda params: optax.EmptyState(),
        lambda updates, state, params=None: (jax.tree.map(lambda u, m: u * m, updates, factors), state),
    )


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """optax.clip_by_global_norm as one factor, min(1, max_norm / norm), that multiplies every gradient.

    optax divides every gradient by the norm, elementwise, inside a select; XLA's CPU backend writes that divided
    copy of every gradient to memory before AdamW reads it (docs/benchmarks.md#bf16-on-both-sides). A
    multiplication by one scalar fuses into AdamW's update instead. The state is optax's (empty).

    `grad_norm`, when the caller has the gradients' norm already (the step checks it is finite), is used instead
    of reading every gradient again."""

    def update(
        updates: Any, state: Any, params: Any = None, *, grad_norm: jax.Array | None = None, **extra: Any
    ) -> tuple[Any, Any]:
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
        return jax.tree.map(lambda t: t * factor.astype(t.dtype), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def make_optimizer(cfg: OptimConfig, params: Any = None, num_layers: int = 0) -> optax.GradientTransformation:
    """clip -> AdamW, with the learning rate an injected hyperparameter set each step; then per-parameter lr
    factors when layer_decay or head_lr ask for them (which needs `params` and `num_layers`)."""
    adamw = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(
        learning_rate=cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask
    )
    clip = optax.identity() if cfg.clip_norm is None else clip_by_global_norm(cfg.clip_norm)
    if cfg.layer_decay == 1.0 and cfg.head_lr in (None, cfg.lr):
        return optax.chain(clip, adamw)
    if params is None:
        raise ValueError("layer_decay and head_lr need the parameters")
    return optax.chain(clip, adamw, _scale_by_tree(lr_multipliers(cfg, params, num_layers)))


def set_learning_rate(opt_state: Any, lr: jax.Array) -> Any:
    """The optimizer state with this step's learning rate, set by its hyperparameter's name."""
    return optax.tree_utils.tree_set(opt_state, learning_rate=lr)


def pretraining_optimizer(cfg: OptimConfig, params: Any, model: Any, ema: float = 0.0) -> optax.GradientTransformation:
    """A pretraining run's optimizer, as its checkpoints hold its state: make_optimizer's, with the weights' moving
    average when `ema` is set (train/ema.py), and a loss scale when `model` (a ModelConfig) computes in float16."""
    return with_loss_scale(with_ema(make_optimizer(cfg, params, model.num_layers), ema), model.dtype)
