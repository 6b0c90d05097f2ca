"""The pretraining objectives, masked LM ('mlm') and replaced-token detection ('rtd'): for each, the model it trains,
its jitted train and validation steps, its validation metrics, its FLOPs and the model a run exports."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bertforge.data.masking import MaskingSpec, continuation_table
from bertforge.data.mixture import MixedShards
from bertforge.data.shards import Shards
from bertforge.model.architectures import build
from bertforge.model.config import ModelConfig
from bertforge.model.heads import Model
from bertforge.model.rtd import Pair, build_pair, discriminator_alone, generator_config
from bertforge.runtime.devices import fetch, global_array
from bertforge.tokenizer.load import Tokenizer
from bertforge.train import loop, rtd_step
from bertforge.train.flops import train_flops_per_token
from bertforge.train.metrics import binary_auc
from bertforge.train.step import StepConfig, eval_sums, prediction_capacity, train_step


def masking_spec(cfg: Any, tokenizer: Tokenizer, special: dict[str, Any], vocab: int) -> MaskingSpec:
    """The masks of pretraining config `cfg` for `tokenizer` (whole words when cfg.mlm.whole_word)."""
    continues = ()
    if cfg.mlm.whole_word:
        vocabulary = tokenizer.tok.get_vocab(with_added_tokens=True)
        continues = continuation_table(vocabulary, vocab, special=special["all"], **tokenizer.word_marks())
    return MaskingSpec(
        mask_id=int(special["mask"]),
        vocab_size=tokenizer.vocab_size,
        special_ids=tuple(int(i) for i in special["all"]),
        rate=cfg.mlm.rate,
        mask_fraction=cfg.mlm.mask_fraction,
        random_fraction=cfg.mlm.random_fraction,
        continues_word=continues,
    )


def build_model(cfg: Any, model_cfg: ModelConfig, seed: int) -> nnx.Module:
    """A fresh model for the objective: a masked-LM model, or a generator and discriminator pair."""
    if cfg.objective == "rtd":
        return build_pair(model_cfg, cfg.rtd, seed)
    return build(model_cfg, "mlm", seed=seed)


def exported(model: nnx.Module) -> Model:
    """The model a run of this objective exports: the masked-LM model, or the discriminator alone."""
    return discriminator_alone(model) if isinstance(model, Pair) else model


def compile_steps(
    cfg: Any,
    graphdef: Any,
    rest: Any,
    tx: Any,
    state_shardings: Any,
    mesh: jax.sharding.Mesh,
    seq_len: int,
    masking: MaskingSpec,
    pad_id: int,
    packed_cls: int | None = None,
) -> tuple[Any, Any]:
    """The jitted train step (state donated, laid out as `state_shardings`) and the jitted validation step;
    `packed_cls` the [CLS] id of packed shards, whose rows hold several sequences."""
    groups = mesh.shape["data"] * mesh.shape["fsdp"]
    micro = cfg.train.global_batch // cfg.train.grad_accum
    step_cfg = StepConfig(
        masking=masking,
        pad_id=pad_id,
        grad_accum=cfg.train.grad_accum,
        sparse_head=cfg.train.sparse_head,
        groups=groups,
        capacity=prediction_capacity(micro // groups * seq_len, cfg.mlm.rate),
        packed_cls=packed_cls,
    )
    if cfg.objective == "rtd":
        rtd_cfg = rtd_step.RtdStepConfig(step_cfg, cfg.rtd.disc_weight, cfg.rtd.temperature)
        step_jit = loop.compile_train_step(rtd_step.train_step, graphdef, rest, tx, rtd_cfg, state_shardings)
        return step_jit, jax.jit(functools.partial(rtd_step.eval_outputs, graphdef, rest, cfg=rtd_cfg))
    step_jit = loop.compile_train_step(train_step, graphdef, rest, tx, step_cfg, state_shardings)
    return step_jit, jax.jit(functools.partial(eval_sums, graphdef, rest, cfg=step_cfg))


def evaluate(eval_fn: Any, params: Any, valid: Shards, cfg: Any, mesh: Any) -> dict[str, float]:
    """The validation metrics, with masks (and replacements) fixed across evaluations: masked LM's loss, perplexity
    and accuracy; for replaced-token detection also the discriminator's loss, accuracy and AUC, and `valid_loss`
    is the combined loss."""
    b = cfg.train.global_batch
    n_batches = math.ceil(valid.num_sequences / b)
    if cfg.eval.max_batches is not None:
        n_batches = min(n_batches, cfg.eval.max_batches)
    key = jax.random.key(cfg.train.seed + 1_000_003)
    rtd = cfg.objective == "rtd"
    totals = jnp.zeros(len(rtd_step.SUMS) if rtd else 3)
    scores, labels = [], []
    for i in range(n_batches):
        rows = np.arange(i * b, min((i + 1) * b, valid.num_sequences))
        ids = np.full((b, valid.seq_len), valid.pad_id, np.int32)  # the last batch is padded: nothing to predict
        ids[: len(rows)] = valid.rows(rows)
        out = eval_fn(params, global_array(ids, mesh), jax.random.fold_in(key, i))
        if rtd:
            logits, replaced, real = fetch(out[1:])
            scores.append(logits[real])
            labels.append(replaced[real])
            out = out[0]
        totals = totals + out
    if rtd:
        means = {k: float(v) for k, v in rtd_step.summary(jax.device_get(totals), cfg.rtd.disc_weight).items()}
        loss = means.pop("gen_loss")
        auc = binary_auc(np.concatenate(scores), np.concatenate(labels)) if scores else float("nan")
        return {
            "valid_loss": means.pop("loss"),
            "valid_gen_loss": loss,
            "valid_gen_perplexity": math.exp(min(loss, 50)),
            **{f"valid_{k}": v for k, v in means.items()},
            "valid_disc_auc": auc,
        }
    loss_sum, correct, count = (float(x) for x in jax.device_get(totals))
    loss = loss_sum / max(count, 1)
    return {"valid_loss": loss, "valid_perplexity": math.exp(min(loss, 50)), "valid_accuracy": correct / max(count, 1)}


def evaluate_mixture(eval_fn: Any, params: Any, valid: MixedShards, cfg: Any, mesh: Any) -> dict[str, float]:
    """evaluate() on each source's validation split (valid_loss_NAME, ...), and their mean by the mixture's weights
    over the sources that have one: the loss on the mixture's own distribution."""
    per, weights = {}, []
    for name, part, weight in zip(valid.names, valid.parts, valid.weights, strict=True):
        if part.num_sequences:
            per[name] = evaluate(eval_fn, params, part, cfg, mesh)
            weights.append(weight)
    shares = np.asarray(weights) / sum(weights)
    keys = next(iter(per.values())).keys()
    mean = {k: float(sum(s * m[k] for s, m in zip(shares, per.values(), strict=True))) for k in keys}
    return {**mean, **{f"{k}_{name}": v for name, m in per.items() for k, v in m.items()}}


def flops_per_token(cfg: Any, model_cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: the generator's at the masked positions and the discriminator's at every token."""
    rate = cfg.mlm.rate if cfg.train.sparse_head or cfg.objective == "rtd" else 1.0
    if cfg.objective != "rtd":
        return train_flops_per_token(model_cfg, seq_len, rate)
    generator = train_flops_per_token(generator_config(model_cfg, cfg.rtd), seq_len, rate)
    d = model_cfg.hidden_size
    return generator + train_flops_per_token(model_cfg, seq_len, 0.0) + 6.0 * (d * d + d)
