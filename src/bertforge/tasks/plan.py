"""`bertforge plan`: memory per device of a pretraining config on a mesh, before paying for the mesh.

Parameters, optimizer state and gradients are counted exactly from the model's shapes and the sharding rules of
runtime/devices.py. Activations are the buffers the compiled step keeps alive at its peak, counted per layer:

    16 (tokens x hidden) + 3 (tokens x intermediate) + S (heads x length^2 per sequence)   float32 values

(inputs of the four projections, q/k/v and the attention output, the LayerNorm inputs and statistics, the GELU's
intermediates, the attention probabilities and their backward), plus the vocabulary side: the tied embedding's
gradient (vocab x hidden) and the logits of the masked positions (capacity x vocab). In the head's backward the
compiler keeps about half a second logits buffer alive, so the vocabulary side's peak is the larger of 1.5 logits
and logits + one (tokens x intermediate) transient. The peak is the larger of that activation peak and the end of
the step, where the gradients and the optimizer's update temporaries (2 x parameters) are alive together.
These counts were read off XLA's buffer assignment; tests/test_plan.py holds the estimate to within 10% of the
memory JAX reports for the compiled step, tiny through base. S is the architecture's SCORE_BUFFERS, fitted to
the compiled step: BERT's 2 (the attention probabilities and their dropout mask, which dropout.keep_mask's hash
lets XLA fuse), DeBERTa's 4 with its relative-position scores, ModernBERT's 4 without dropout. Other backends
fuse differently, so treat the figure as a guide with a margin, and check it on the device with --compile.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from bertforge.data.masking import MaskingSpec
from bertforge.data.shards import Shards
from bertforge.errors import UserError
from bertforge.model.architectures import build, family_module
from bertforge.model.config import ModelConfig
from bertforge.runtime.devices import (
    MESH_AXES,
    batch_sharding,
    build_mesh,
    check_batch_split,
    logical_axes,
    mesh_shape,
    param_shardings,
    spec_for,
)
from bertforge.tasks.pretrain import PretrainConfig
from bertforge.train import objectives
from bertforge.train.objectives import compile_steps
from bertforge.train.optim import pretraining_optimizer
from bertforge.train.step import abstract_train_state, prediction_capacity

MiB = 2**20
ADAM_MOMENTS = 2


@dataclasses.dataclass(frozen=True)
class Plan:
    """Bytes per device of one train step."""

    devices: int
    mesh: dict[str, int]
    micro_batch: int  # sequences per device per micro-batch
    seq_len: int
    parameters: int
    optimizer: int
    gradients: int
    activations: int
    peak: int

    def table(self) -> str:
        rows = [
            ("parameters (float32)", self.parameters),
            ("optimizer state (AdamW moments; with train.ema, its copy)", self.optimizer),
            ("gradients", self.gradients),
            ("activations at the peak", self.activations),
            ("peak of the step", self.peak),
        ]
        lines = ["| per device | MiB |", "|---|---|"]
        lines += [f"| {name} | {value / MiB:,.1f} |" for name, value in rows]
        return "\n".join(lines)


def resolve_mesh(cfg: PretrainConfig, devices: int) -> dict[str, int]:
    """The mesh shape `cfg.mesh` gives on `devices` devices, checked as `bertforge pretrain` checks it."""
    try:
        shape = mesh_shape(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, devices)
    except ValueError as e:
        raise UserError(f"config 'mesh': {e}") from None
    check_batch_split(shape, cfg.train.global_batch, cfg.train.grad_accum, "train.global_batch")
    return shape


def parameter_bytes(model_cfg: ModelConfig, sizes: dict[str, int]) -> tuple[int, int]:
    """(bytes per device, bytes in all) of the float32 parameters, split as the sharding rules split them."""
    model = nnx.eval_shape(lambda: build(model_cfg, "mlm"))
    per_device = total = 0
    for var in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, nnx.Variable)):
        shape = var.get_value().shape
        size = math.prod(shape) * 4
        spec = spec_for(sizes, logical_axes(var), shape)
        split = 1
        for axes in spec:
            names = (axes,) if isinstance(axes, str) else (axes or ())
            split *= math.prod(sizes[n] for n in names)
        per_device += size // split
        total += size
    return per_device, total


def estimate(cfg: PretrainConfig, devices: int, seq_len: int) -> Plan:
    """The memory per device of `cfg`'s train step on `devices` devices with sequences of `seq_len` tokens."""
    m = cfg.model
    mesh = resolve_mesh(cfg, devices)
    shards = mesh["data"] * mesh["fsdp"]
    b = cfg.train.global_batch // cfg.train.grad_accum // shards
    n = b * seq_len
    d, f, v, heads, layers = m.hidden_size, m.intermediate_size, m.vocab_size, m.num_heads, m.num_layers
    params, _ = parameter_bytes(m, mesh)
    optimizer = (ADAM_MOMENTS + (1 if cfg.train.ema else 0)) * params  # train.ema: one more copy
    gradients = params
    act = 2 if m.dtype == "bfloat16" else 4  # hidden states; attention probabilities stay float32
    scores = family_module(m).SCORE_BUFFERS  # float32 (heads x length^2) buffers per layer
    layer = (16 * n * d + 3 * n * f) * act + scores * b * heads * seq_len**2 * 4
    predicted = prediction_capacity(n, cfg.mlm.rate) if cfg.train.sparse_head else n
    logits = predicted * v * 4
    saved = layer * (1 if m.remat else layers) + (n * d * act * layers if m.remat else 0)
    activations = saved + v * d * 4 + 3 * n * d * act + max(logits + n * f * act, logits * 3 // 2)
    extra = params if cfg.train.grad_accum > 1 else 0  # the accumulated gradients carried across micro-batches
    if shards > 1:
        extra += v * d * 4 // mesh["fsdp"]  # the embedding gradient's reduction buffer
    peak = params + optimizer + max(activations, 2 * gradients) + extra
    return Plan(devices, mesh, b, seq_len, params, optimizer, gradients, activations, peak)


def compiled_bytes(cfg: PretrainConfig, seq_len: int) -> int:
    """The memory per device JAX reports for `cfg`'s compiled train step on this machine's devices (arguments,
    outputs and temporaries, donated buffers counted once). Compiles without allocating the model."""
    mesh = build_mesh(cfg.mesh, cfg.train.global_batch, cfg.train.grad_accum, "train.global_batch")
    model = nnx.eval_shape(lambda: objectives.build_model(cfg, cfg.model, 0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rest = jax.tree.map(
        lambda a: jax.random.key(0) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else jnp.zeros(a.shape, a.dtype),
        rest,
    )
    params = jax.tree.map(
        lambda s, var: var.replace(jax.ShapeDtypeStruct(var.get_value().shape, var.get_value().dtype, sharding=s)),
        param_shardings(model, mesh),
        params,
    )
    tx = pretraining_optimizer(cfg.optim, params, cfg.model, cfg.train.ema)
    state = abstract_train_state(params, tx, mesh)
    specials = tuple(range(5))
    masking = MaskingSpec(mask_id=4, vocab_size=cfg.model.vocab_size, special_ids=specials, rate=cfg.mlm.rate)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    step, _ = compile_steps(cfg, graphdef, rest, tx, shardings, mesh, seq_len, masking, 0)
    ids = jax.ShapeDtypeStruct((cfg.train.global_batch, seq_len), jnp.int32, sharding=batch_sharding(mesh))
    stats = step.lower(state, ids, jnp.float32(1.0), jax.random.key(0)).compile().memory_analysis()
    return int(
        stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    )


@dataclasses.dataclass(frozen=True)
class PlanConfig(PretrainConfig):
    """A pretraining config, and the mesh and sequences to plan it for."""

    devices: int | None = None  # devices of the mesh (default: mesh.num_devices, else this machine's)
    seq_len: int | None = None  # tokens per sequence (default: the shards' of --data, else 128)
    shards: str = ""  # shard folder, for its sequence length
    compile: bool = False  # also compile the step here and show JAX's figure


def main(cfg: PlanConfig) -> tuple[Plan, int | None]:
    """The plan, and with `compile` the compiled step's figure on this machine's devices (None otherwise)."""
    seq_len = cfg.seq_len
    if seq_len is None and cfg.shards:
        seq_len = Shards(cfg.shards, "train").seq_len
    seq_len = seq_len or 128
    devices = cfg.devices if cfg.devices is not None else cfg.mesh.num_devices or jax.device_count()
    if seq_len > cfg.model.max_seq_len:
        raise UserError(f"--seq-len {seq_len} is longer than the model's {cfg.model.max_seq_len} positions")
    if cfg.objective == "rtd" and not cfg.compile:
        raise UserError("the closed-form plan is masked LM's; plan objective rtd with --compile (JAX's own figure)")
    plan = estimate(cfg, devices, seq_len)
    measured = None
    if cfg.compile:
        if devices != len(jax.devices()) and not cfg.mesh.num_devices:
            raise UserError(f"--compile compiles for this machine's {len(jax.devices())} devices; drop --devices")
        measured = compiled_bytes(cfg, seq_len)
    return plan, measured


def describe(cfg: PretrainConfig, plan: Plan) -> str:
    m = cfg.model
    mesh = ", ".join(f"{k} {plan.mesh[k]}" for k in MESH_AXES)
    return (
        f"{m.num_layers}x{m.hidden_size} {m.family} ({parameter_bytes(m, plan.mesh)[1] / 4e6:.1f} M parameters"
        f"{', remat' if m.remat else ''}, "
        f"{m.dtype}) on {plan.devices} device(s) [{mesh}]: global batch {cfg.train.global_batch}"
        f"{f' in {cfg.train.grad_accum} micro-batches' if cfg.train.grad_accum > 1 else ''}, "
        f"{plan.micro_batch} sequences x {plan.seq_len} tokens per device per micro-batch"
    )
