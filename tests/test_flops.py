"""Model FLOPs per token (MFU's numerator) against what the models hold and compute."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from bertforge.model.architectures import FAMILIES, build
from bertforge.model.config import ModelConfig, preset
from bertforge.train.flops import train_flops_per_token


def family_config(family: str, **overrides) -> ModelConfig:
    base = dataclasses.asdict(preset("test", intermediate_size=48, num_layers=3))
    return ModelConfig(**{**FAMILIES[family].apply(base), "family": family, **overrides})


@pytest.mark.parametrize("family", ["bert", "modernbert", "deberta-v2"])
def test_dense_flops_are_six_times_the_layers_matrix_weights(family):
    # At 0 tokens of context and no prediction, a token's training FLOPs are those of its dense products: 2
    # (multiply and add) x 3 (forward, and the backward's two products) per weight of the layers' matrices.
    cfg = family_config(family)
    layers = nnx.state(build(cfg, "mlm").encoder.layers, nnx.Param)
    weights = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(layers) if x.ndim == 2)
    assert train_flops_per_token(cfg, 0, 0.0) == 6 * weights


def test_attention_flops_count_the_keys_each_query_sees():
    # 3 layers at 256 tokens: ModernBERT's layer 0 is global (256 keys), layers 1 and 2 see 64 keys on each side
    # and their own (129); BERT's all see 256. Scores and weighted values: 2 x keys x width, 6x for training.
    d, t = 32, 256
    bert, modern = family_config("bert"), family_config("modernbert", local_attention=128)
    assert train_flops_per_token(bert, t, 0.0) - train_flops_per_token(bert, 0, 0.0) == 6 * 2 * d * (3 * 256)
    assert train_flops_per_token(modern, t, 0.0) - train_flops_per_token(modern, 0, 0.0) == 6 * 2 * d * (256 + 2 * 129)


def test_relative_attention_adds_the_position_scores():
    # DeBERTa-v3: per layer, c2p and p2c score each query against 2 x 256 buckets of the relative table, beside
    # the 2 x 512 products of content attention.
    d, t = 32, 512
    cfg = family_config("deberta-v2", position_buckets=256, max_position_embeddings=512)
    assert set(cfg.pos_att_type) == {"c2p", "p2c"}
    extra = train_flops_per_token(cfg, t, 0.0) - train_flops_per_token(cfg, 0, 0.0)
    assert extra == 6 * d * 3 * (2 * 512 + 2 * 512)


def test_the_sparse_head_counts_the_predicted_positions_only():
    cfg = family_config("bert")
    head = (cfg.hidden_size + cfg.vocab_size) * cfg.hidden_size
    assert train_flops_per_token(cfg, 64, 0.15) - train_flops_per_token(cfg, 64, 0.0) == pytest.approx(6 * 0.15 * head)
