"""Dropout whose mask is a keyed hash of each element's position.

A dropout mask needs a few bits of randomness per element, and jax's counter-based generator (threefry: 20
rounds of mixing per 32-bit word, run as a loop of its own on a CPU) was the expensive part of a fine-tuning step
with dropout. Here each element's draw is a keyed integer hash of its index (two rounds of a 32-bit finaliser with
good avalanche, `mix`), a few integer operations that XLA fuses into the mask's consumer: about a quarter of the
generator's time for the attention probabilities' mask, and no generator loop to compile (docs/benchmarks.md).
The hash is keyed by the dropout key's own words, so masks stay a pure function of the key: a resumed run draws
the same ones. Each element takes its hash's top 16 bits: a keep probability rounded to a multiple of 2^-16 (at
most 8e-6 away from 1 - rate), whose exact value the kept elements are scaled by, so the mask stays unbiased.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import rnglib

LEVELS = 1 << 16


def keep_threshold(rate: float) -> int:
    """The number of the 2^16 levels that keep an element: round((1 - rate) * 2^16), at least 1 (a rate within
    2^-17 of 1 keeps one level in 2^16 rather than dividing by zero)."""
    return max(1, round((1.0 - rate) * LEVELS))


def mix(h: jax.Array) -> jax.Array:
    """A bijective 32-bit finaliser (uint32 -> uint32) whose every output bit depends on every input bit: two
    multiply-xorshift rounds with constants found by search for low bias ("lowbias32", C. Wellons, 2018)."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> 15)
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> 16)


def keep_mask(key: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """A boolean mask of `shape`, True where an element is kept (probability keep_threshold(rate) / 2^16).

    Each element's draw is mix(mix(i ^ r) + s): i its index within its row (the flat index over every dimension
    but the first; masks of more than 2^32 elements a row would repeat), r = mix(row ^ s0), s = s1, with s0 and
    s1 the first two words of `key`'s data: a key from jax's split or fold_in is itself random bits, and using them
    as they are leaves no generator loop in the program. Every index is computed from iota, so a sharded batch
    computes its own rows."""
    if not shape:
        return keep_mask(key, rate, (1,)).reshape(())
    s0, s1 = jax.random.key_data(key).reshape(-1)[:2].astype(jnp.uint32)
    rows = mix(jax.lax.broadcasted_iota(jnp.uint32, shape, 0) ^ s0)
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for d in range(len(shape) - 1, 0, -1):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, d) * jnp.uint32(stride % (1 << 32))
        stride *= shape[d]
    draw = mix(mix(index ^ rows) + s1) >> 16
    # Compared as int32: the threshold reaches 2^16 (keep all) for rates under 2^-17, which uint16 cannot hold.
    return draw.astype(jnp.int32) < keep_threshold(rate)


def derive(key: jax.Array, i: int | jax.Array) -> jax.Array:
    """The key numbered `i` under `key`, as jax.random.fold_in(key, i) but by `mix` over the key's words, for keys
    that only dropout masks read (keep_mask, again by the hash): no generator loop to compile in the step."""
    data = jax.random.key_data(key)
    words = data.reshape(-1)
    salt = mix(jnp.asarray(i, jnp.uint32) + jnp.uint32(0x9E3779B9))
    first = mix(words[0] ^ mix(words[1] ^ salt))
    second = mix(first + words[1] + jnp.uint32(0x85EBCA6B))
    data = words.at[0].set(first).at[1].set(second).reshape(data.shape)
    return jax.random.wrap_key_data(data, impl=jax.random.key_impl(key))


def split_key(key: jax.Array | None, n: int) -> tuple[jax.Array | None, ...]:
    """n keys derived from `key` (derive(key, 0..n-1)), as jax.random.split gives them for threefry; n Nones for
    an inactive dropout's None."""
    return (None,) * n if key is None else tuple(derive(key, i) for i in range(n))


def next_key(stream: rnglib.RngStream) -> jax.Array:
    """stream(): the stream's next key (its count advances), by derive where nnx's RngStream folds in by
    threefry."""
    count = stream.count.get_value()  # not count[...]: see architectures.ParamStream
    key = derive(stream.key.get_value(), count)
    stream.count.set_value(count + 1)
    return key


def draws(model: nnx.Module) -> bool:
    """Whether any of the model's dropout layers draws a mask (a rate above 0): only then do its steps need keys."""
    return any(isinstance(m, nnx.Dropout) and m.rate > 0 for _, m in nnx.iter_graph(model))


def dropped(x: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """x where `keep` is True, scaled by 1 / the keep probability, and 0 elsewhere; x itself where keep is None."""
    if keep is None:
        return x
    scale = jnp.asarray(LEVELS / keep_threshold(rate), x.dtype)
    return jnp.where(keep, x * scale, jnp.zeros((), x.dtype))


class Dropout(nnx.Dropout):
    """nnx.Dropout (same constructor, rate, broadcast dimensions, deterministic switch and key stream) with the
    mask drawn by keep_mask."""

    def __call__(
        self,
        inputs: jax.Array,
        *,
        deterministic: bool | None = None,
        rngs: rnglib.Rngs | rnglib.RngStream | jax.Array | None = None,
    ) -> jax.Array:
        if self.rate == 0.0 or (self.deterministic if deterministic is None else deterministic):
            return inputs
        if self.rate == 1.0:
            return jnp.zeros_like(inputs)
        rngs = self.rngs if rngs is None else rngs
        if isinstance(rngs, rnglib.Rngs):
            key = next_key(rngs[self.rng_collection])
        elif isinstance(rngs, rnglib.RngStream):
            key = next_key(rngs)
        elif isinstance(rngs, jax.Array):
            key = rngs
        else:
            raise TypeError(f"rngs must be an Rngs, an RngStream or a key, not {type(rngs).__name__}")
        shape = tuple(1 if i in self.broadcast_dims else n for i, n in enumerate(inputs.shape))
        return dropped(inputs, jnp.broadcast_to(keep_mask(key, self.rate, shape), inputs.shape), self.rate)
