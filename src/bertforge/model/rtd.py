"""Replaced-token detection (ELECTRA, Clark et al. 2020; DeBERTa-v3, He et al. 2021): a small masked-LM generator
and the discriminator that tells its samples from the original tokens, built as one module so that one optimizer
and one jitted step train both.

The generator is a narrower (`generator_width`) and/or shallower (`generator_depth`) model of the discriminator's
architecture. Their word embeddings are shared in one of three ways:
- 'electra': one table, which both losses train (ELECTRA's tied embeddings);
- 'gdes': gradient-disentangled sharing (DeBERTa-v3): the discriminator looks words up in the generator's table,
  with its gradient stopped, plus a residual table of its own that starts at zero; only the masked-LM loss trains
  the shared table, only the detection loss the residual;
- 'none': each model has its own table.
What a user fine-tunes is `discriminator_alone(pair)`: a plain discriminator whose table is the sum.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.errors import UserError
from bertforge.model.architectures import build
from bertforge.model.config import ModelConfig
from bertforge.model.heads import Discriminator, MaskedLM
from bertforge.model.layers import axes

SHARING = ("electra", "gdes", "none")


@dataclasses.dataclass(frozen=True)
class RtdConfig:
    generator_width: float = 0.25  # the generator's hidden size as a share of the discriminator's (ELECTRA: 1/4)
    generator_depth: float = 1.0  # its layers as a share of the discriminator's (DeBERTa-v3: 1/2)
    sharing: str = "electra"  # word embeddings: electra (one table), gdes (DeBERTa-v3's), none
    disc_weight: float = 50.0  # the detection loss's weight against the masked-LM loss (both papers: 50)
    temperature: float = 1.0  # of the softmax the replacements are sampled from

    def __post_init__(self) -> None:
        if self.sharing not in SHARING:
            raise ValueError(f"sharing {self.sharing!r} is not one of {', '.join(SHARING)}")
        for name in ("generator_width", "generator_depth"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.disc_weight <= 0 or self.temperature <= 0:
            raise ValueError("disc_weight and temperature must be positive")


def generator_config(disc: ModelConfig, rtd: RtdConfig) -> ModelConfig:
    """The generator: the discriminator's architecture at `generator_width` of its hidden size (heads of the same
    size) and `generator_depth` of its layers, with an embedding table as wide as the discriminator's."""
    hidden = max(disc.head_dim, int(round(disc.hidden_size * rtd.generator_width / disc.head_dim)) * disc.head_dim)
    width = disc.embed_dim
    if width != hidden and disc.family in ("modernbert", "distilbert"):
        raise UserError(
            f"rtd.generator_width={rtd.generator_width}: {disc.family} has no embedding projection, so its "
            "generator must be as wide as the discriminator (rtd.generator_width=1; make it smaller with "
            "rtd.generator_depth)"
        )
    return dataclasses.replace(
        disc,
        hidden_size=hidden,
        num_heads=hidden // disc.head_dim,
        intermediate_size=max(1, int(round(disc.intermediate_size * hidden / disc.hidden_size))),
        num_layers=max(1, int(round(disc.num_layers * rtd.generator_depth))),
        embedding_size=0 if width == hidden else width,
    )


class GradientStopped(nnx.Module):
    """DeBERTa-v3's embedding sharing: the generator's table (its gradient stopped) plus a residual table."""

    def __init__(self, shared: nnx.Embed):
        self.shared = shared
        table = shared.embedding[...]
        self.delta = nnx.Param(jnp.zeros(table.shape, jnp.float32), **axes("vocab", "embed"))

    @property
    def embedding(self) -> jax.Array:
        return jax.lax.stop_gradient(self.shared.embedding[...]) + self.delta[...]  # (V, E)

    def __call__(self, ids: jax.Array) -> jax.Array:
        """(B, T) ids -> (B, T, E)."""
        return jax.lax.stop_gradient(self.shared(ids)) + jnp.take(self.delta[...], ids, axis=0)


class Pair(nnx.Module):
    """The generator and the discriminator trained together (see the module's docstring)."""

    task = "rtd-pair"

    def __init__(self, generator: MaskedLM, discriminator: Discriminator, sharing: str):
        self.config = discriminator.config
        self.sharing = sharing
        self.generator = generator
        self.discriminator = discriminator
        words = generator.encoder.embeddings.word
        if sharing == "electra":
            discriminator.encoder.embeddings.word = words
        elif sharing == "gdes":
            discriminator.encoder.embeddings.word = GradientStopped(words)


def build_pair(disc: ModelConfig, rtd: RtdConfig, seed: int = 0) -> Pair:
    """A freshly initialised generator and discriminator, their embeddings shared as `rtd.sharing` says."""
    generator = build(generator_config(disc, rtd), "mlm", seed=seed + 7)
    assert isinstance(generator, MaskedLM)
    discriminator = build(disc, "rtd", seed=seed)
    assert isinstance(discriminator, Discriminator)
    return Pair(generator, discriminator, rtd.sharing)


def discriminator_alone(pair: Pair) -> Discriminator:
    """The discriminator with a word table of its own: the shared one, plus the residual with 'gdes'."""
    alone = build(pair.config, "rtd")
    assert isinstance(alone, Discriminator)
    params = nnx.to_pure_dict(nnx.state(pair.discriminator, nnx.Param))
    words = params["encoder"]["embeddings"]["word"]
    if pair.sharing == "gdes":
        params["encoder"]["embeddings"]["word"] = {"embedding": words["shared"]["embedding"] + words["delta"]}
    state = nnx.state(alone, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(alone, state)
    return alone
