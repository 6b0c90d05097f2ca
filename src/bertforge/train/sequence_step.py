"""The pure, jitted train and predict steps of fine-tuning a sequence head, and the losses by name.

A batch is a dict of (B, T) input_ids / attention_mask / token_type_ids (or of rows that pack B texts,
data/text_packing.py), targets ((B, L) float for regression and
multi-label, (B,) int for classification) and weight (B,): 0 for filler rows, otherwise 1 or an importance weight.
The loss is the weighted sum over the rows divided by the number of real rows of the whole batch, so gradient
accumulation gives the update of the full batch.

With `sparse_embeddings`, the word-embedding table is updated lazily: the step reads, updates and writes only the
rows of the tokens in the batch (padding included), with AdamW's own arithmetic and step count, and every other row
keeps its weights and moments. Plain AdamW also moves the other rows, by their momentum and weight decay, so the
numbers differ; what it saves is AdamW's pass over the whole table (about half of a small model's parameters).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bertforge.data.text_packing import PACKED_INPUTS
from bertforge.train.ahead import Ahead
from bertforge.train.contrastive import ContrastiveConfig
from bertforge.train.embedding_step import contrastive_gradients
from bertforge.train.loss_scale import scale_of, scaled, unscale
from bertforge.train.optim import param_names
from bertforge.train.step import TrainState, accumulate, apply_update, micro_batches, stream_keys, with_stream_keys

LossFn = Callable[[jax.Array, jax.Array], jax.Array]  # (outputs (B, L), targets) -> per-row loss (B,)
LOSSES: dict[str, LossFn] = {}
PER_TOKEN: set[str] = set()  # losses summed over each row's labelled tokens, and averaged over the batch's tokens


def register_loss(name: str, per_token: bool = False) -> Callable[[LossFn], LossFn]:
    """Make a per-row loss available as `head.loss: NAME` in fine-tuning configs. A `per_token` loss returns each
    row's sum over its labelled tokens (label >= 0), and the batch's loss is divided by their number, not the
    rows'."""

    def add(fn: LossFn) -> LossFn:
        LOSSES[name] = fn
        if per_token:
            PER_TOKEN.add(name)
        return fn

    return add


@register_loss("mse")
def mse(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean((outputs - targets) ** 2, axis=-1)


@register_loss("mae")
def mae(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean(jnp.abs(outputs - targets), axis=-1)


@register_loss("cross_entropy")
def cross_entropy(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(outputs, targets)


@register_loss("bce")
def bce(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    return jnp.mean(optax.sigmoid_binary_cross_entropy(outputs, targets), axis=-1)


@register_loss("token_cross_entropy", per_token=True)
def token_cross_entropy(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    """outputs (B, T, L), targets (B, T', 2) with T' >= T: each token's label in [..., 0], -100 where it has none
    (and past T)."""
    labels = targets[:, : outputs.shape[1], 0]  # (B, T)
    labelled = labels >= 0
    ce = optax.softmax_cross_entropy_with_integer_labels(outputs, jnp.where(labelled, labels, 0))
    return jnp.sum(jnp.where(labelled, ce, 0.0), axis=-1)


@register_loss("span_cross_entropy")
def span_cross_entropy(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    """outputs (B, T, 2) start and end logits, targets (B, 4): the answer's first and last token, the row, and its
    number of tokens, past which no position is a candidate. The mean of the two cross-entropies, as
    transformers' *ForQuestionAnswering computes its loss."""
    real = jnp.arange(outputs.shape[1])[None, :] < targets[:, 3:4]  # (B, T)
    logits = jnp.where(real[..., None], outputs, -1e9)
    start = optax.softmax_cross_entropy_with_integer_labels(logits[..., 0], targets[:, 0])
    end = optax.softmax_cross_entropy_with_integer_labels(logits[..., 1], targets[:, 1])
    return (start + end) / 2


def counted(loss: str | None, targets: Any, weight: Any) -> Any:
    """What a batch's weighted loss sum counts: its real rows (weight > 0), or for a per-token loss their labelled
    tokens. Array methods only, so that a step's NumPy targets on the host count as its jax batch does."""
    real = weight > 0
    if loss in PER_TOKEN:
        real = (targets[..., 0] >= 0) & real[:, None]
    return real.sum()


def loss_count(loss: str, targets: jax.Array, weight: jax.Array) -> jax.Array:
    """What a batch's weighted loss sum is averaged over: counted, at least 1."""
    return jnp.maximum(counted(loss, targets, weight), 1).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class SequenceStepConfig:
    loss: str
    grad_accum: int = 1
    sparse_embeddings: bool = False  # update only the word-embedding rows of the batch's tokens (see above)
    # Rows the lazy update has room for: at least any batch's tokens. One number for every padded length, so the
    # update compiles once; 0: each batch's own token count.
    row_capacity: int = 0
    dropout: bool = True  # whether the model draws dropout (dropout.draws): its keys are drawn only then
    # An embedding model's loss over the whole batch (train/contrastive.py); grad_accum then takes the batch in
    # mini-batches of the cached form (train/embedding_step.py), and `loss` is not used.
    contrastive: ContrastiveConfig | None = None


# Where every architecture keeps its word-embedding table among the parameters (and the optimizer's moments).
TABLE = ("encoder", "embeddings", "word", "embedding")


def _is_table(path: tuple) -> bool:
    return tuple(param_names(path)[-len(TABLE) :]) == TABLE


def _on_table(fn: Callable[..., jax.Array], tree: Any, *rest: Any) -> Any:
    """tree with fn(leaf, *rest's leaves) at the word-embedding table (in params, gradients or AdamW's moments),
    and the leaf of the last tree elsewhere."""

    def leaf(path: tuple, x: jax.Array, *others: jax.Array) -> jax.Array:
        if _is_table(path):
            return fn(x, *others)
        return others[-1] if others else x

    return jax.tree_util.tree_map_with_path(leaf, tree, *rest)


def word_table(params: Any) -> jax.Array:
    """The (V, E) word-embedding table among a model's parameters."""
    found = [x for path, x in jax.tree_util.tree_leaves_with_path(params) if _is_table(path)]
    if len(found) != 1:
        raise ValueError(f"expected one word-embedding table at {'.'.join(TABLE)}, found {len(found)}")
    return found[0]


def touched_rows(input_ids: jax.Array, vocab: int, capacity: int) -> jax.Array:
    """(N,) int32: the distinct ids of a (B, T) batch, ascending, then `vocab` (past the table) up to
    N = min(vocab, capacity); capacity >= B * T holds every id."""
    return jnp.unique(input_ids, size=min(vocab, capacity), fill_value=vocab).astype(jnp.int32)


def take_rows(tree: Any, rows: jax.Array) -> Any:
    """tree with its word-embedding table (V, E) cut to `rows` (N, E); rows past the table read as zeros."""
    return _on_table(lambda t: t.at[rows].get(mode="fill", fill_value=0), tree)


def put_rows(full: Any, part: Any, rows: jax.Array) -> Any:
    """`part` (take_rows of `full`, updated) written back: its table's rows into full's table, the rest as is."""
    return _on_table(lambda t, p: t.at[rows].set(p, mode="drop"), full, part)


def dropout_keys(rest: Any, step: jax.Array, key: jax.Array, grad_accum: int) -> tuple[jax.Array, ...]:
    """The key of each of the model's random streams for the update numbered `step`, for each micro-batch: (A,)
    each. The same keys as pretraining's with_dropout_key(rest, k), k the micro-batch's key."""
    keys = jax.random.split(jax.random.fold_in(key, step), grad_accum)
    return jax.vmap(lambda k: stream_keys(rest, k))(keys)


def gradients(
    graphdef: Any,
    rest: Any,
    params: Any,
    keys: tuple[jax.Array, ...] | None,
    batch: dict[str, jax.Array],
    cfg: SequenceStepConfig,
    scale: jax.Array | None = None,
) -> tuple[Any, jax.Array, jax.Array | None]:
    """The gradients of the batch's loss at `params`, dropout keyed by `keys` (dropout_keys'; None for a model
    that draws no dropout), the loss, and with sparse_embeddings the rows of the batch's tokens, to which the
    table's gradient is cut (else None). `scale`: float16's loss scale (loss_scale.py), divided out again."""
    if cfg.contrastive is not None:
        grads, loss = contrastive_gradients(graphdef, rest, params, keys, batch, cfg.contrastive, cfg.grad_accum, scale)
    else:
        grads, loss = summed_gradients(graphdef, rest, params, keys, batch, cfg, scale)
    if not cfg.sparse_embeddings:
        return grads, loss, None
    ids = batch["input_ids"]
    rows = touched_rows(ids, word_table(params).shape[0], max(cfg.row_capacity, ids.size))
    return take_rows(grads, rows), loss, rows


def summed_gradients(
    graphdef: Any,
    rest: Any,
    params: Any,
    keys: tuple[jax.Array, ...] | None,
    batch: dict[str, jax.Array],
    cfg: SequenceStepConfig,
    scale: jax.Array | None,
    count: jax.Array | None = None,
) -> tuple[Any, jax.Array]:
    """(gradients, loss) of a loss that is a sum over the batch's rows, accumulated over its micro-batches, and
    divided by the batch's loss_count, or by `count` when the batch is part of a larger one."""
    loss_of = LOSSES[cfg.loss]
    real = loss_count(cfg.loss, batch["targets"], batch["weight"]) if count is None else count
    micro = {k: micro_batches(v, cfg.grad_accum) for k, v in batch.items()}

    def loss_fn(params: Any, xs: tuple) -> jax.Array:
        b, k = xs
        model = nnx.merge(graphdef, params, rest if k is None else with_stream_keys(rest, k))
        outputs = forward(model, b)  # (b, L)
        return scaled(jnp.sum(loss_of(outputs, b["targets"]) * b["weight"]) / real, scale)

    def grad_fn(params: Any, xs: tuple) -> tuple[jax.Array, Any]:
        return jax.value_and_grad(loss_fn)(params, xs)

    return unscale(*accumulate(grad_fn, params, (micro, keys)), scale)


def update(
    state: TrainState, grads: Any, rows: jax.Array | None, loss: jax.Array, lr: jax.Array, tx: Any
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The optimizer update of `grads`; a non-finite loss leaves the state as it was. With `rows` (gradients cut
    by sparse_embeddings), AdamW runs on the table's rows (their weights and moments cut out, updated, written
    back) and on every other parameter; the norm clipped is the whole gradient's, since the other rows have none."""
    if rows is None:
        new_state, grad_norm, finite = apply_update(state, grads, loss, lr, tx)
        metrics = {"loss": loss, "grad_norm": grad_norm, "finite": finite}
        scale = scale_of(state.opt_state)
        return new_state, metrics if scale is None else {**metrics, "loss_scale": scale}
    part = TrainState(state.step, take_rows(state.params, rows), take_rows(state.opt_state, rows))
    new, metrics = update(part, grads, None, loss, lr, tx)
    params = put_rows(state.params, new.params, rows)
    return TrainState(new.step, params, put_rows(state.opt_state, new.opt_state, rows)), metrics


def train_step(
    graphdef: Any,
    rest: Any,
    state: TrainState,
    batch: dict[str, jax.Array],
    lr: jax.Array,
    key: jax.Array,
    tx: Any,
    cfg: SequenceStepConfig,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from a batch; a non-finite loss leaves the state as it was."""
    keys = dropout_keys(rest, state.step, key, cfg.grad_accum) if cfg.dropout else None
    grads, loss, rows = gradients(graphdef, rest, state.params, keys, batch, cfg, scale_of(state.opt_state))
    return update(state, grads, rows, loss, lr, tx)


class TrainStep:
    """train_step as three programs (compile_train_step): call it as train_step, less its static arguments."""

    def __init__(self, keys_jit: Any, grads: Ahead, update: Ahead, cfg: SequenceStepConfig, shardings: Any):
        self.keys_jit, self.grads, self.update, self.cfg = keys_jit, grads, update, cfg
        self.grad_shardings, self.loss_sharding = shardings

    def __call__(
        self, state: TrainState, batch: dict[str, jax.Array], lr: jax.Array, key: jax.Array
    ) -> tuple[TrainState, dict]:
        keys = self.keys_jit(state.step, key) if self.cfg.dropout else None
        grads, loss, rows = self.grads(state.params, keys, batch, scale=scale_of(state.opt_state))
        return self.update(state, grads, rows, loss, lr)

    def ahead(self, state: TrainState, batch: dict[str, jax.Array], key: jax.Array) -> None:
        """Start compiling the gradients' program for batches shaped as `batch`, and the update's (Ahead.ahead)."""
        keys = self.keys_jit(state.step, key) if self.cfg.dropout else None
        self.grads.ahead(state.params, keys, batch, scale=scale_of(state.opt_state))
        if not self.cfg.sparse_embeddings:  # else the gradients' rows have a layout only their program knows
            grads = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=s), state.params,
                                 self.grad_shardings)  # fmt: skip
            loss = jax.ShapeDtypeStruct((), jnp.float32, sharding=self.loss_sharding)
            self.update.ahead(state, grads, None, loss, jnp.float32(0.0))  # lr as the fold's loop passes it


def compile_train_step(graphdef: Any, rest: Any, tx: Any, cfg: SequenceStepConfig, state_shardings: Any) -> TrainStep:
    """train_step as three programs: the dropout keys and the update, compiled once, and the gradients, compiled
    once per batch shape, ahead of use when asked (TrainStep.ahead).

    Fine-tuning pads its batches to a few lengths, and each length's program compiles whatever it holds again, so
    the update and the dropout keys, the same at every length, are compiled apart once. The state is donated, so
    the update reuses its buffers (the gradients have no output of their shape to go to).
    """
    grad_shardings = state_shardings.params
    if cfg.sparse_embeddings:
        # The table's gradient rows are as many as the batch's tokens: replicated, whatever the table's layout.
        table = word_table(grad_shardings)
        if isinstance(table, jax.sharding.NamedSharding):
            table = jax.sharding.NamedSharding(table.mesh, jax.sharding.PartitionSpec())
        grad_shardings = _on_table(lambda _: table, grad_shardings)
    # The keys are laid out like the step count: replicated over the state's devices.
    keys_jit = jax.jit(
        functools.partial(dropout_keys, rest, grad_accum=cfg.grad_accum), out_shardings=state_shardings.step
    )
    grads_jit = jax.jit(
        functools.partial(gradients, graphdef, rest, cfg=cfg),
        out_shardings=(grad_shardings, state_shardings.step, None),  # the loss replicated, as the step count
    )
    update_jit = jax.jit(functools.partial(update, tx=tx), donate_argnums=0, out_shardings=(state_shardings, None))
    shardings = (grad_shardings, state_shardings.step)
    return TrainStep(keys_jit, Ahead(grads_jit), Ahead(update_jit), cfg, shardings)


def forward(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    """The model's outputs on a batch: padded rows, or rows that pack several texts (data/text_packing.py), whose
    outputs are per text, or per row of N texts (a question's choices: (B, N) scores) when the batch has B rows
    of targets for N * B texts."""
    if "starts" in batch:
        out = model.packed(*(batch[k] for k in PACKED_INPUTS))
        rows = batch["weight"].shape[0] if "weight" in batch else out.shape[0]
        return out if rows == out.shape[0] else out.reshape(rows, -1)
    return model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])


def predict_step(graphdef: Any, rest: Any, params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    """(B, L) float32 outputs, no dropout."""
    model = nnx.merge(graphdef, params, rest)
    model.eval()
    return forward(model, batch)
