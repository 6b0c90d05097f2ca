"""Devices: the mesh, and the one table that maps logical axis names onto it.

Model code names its axes ('batch', 'embed', 'mlp', ...); only this table says which mesh axis each is split
over. Data parallel is ('data',); FSDP shards parameters over 'fsdp'; 'tensor' is for tensor parallelism.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from bertforge.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (or axes, or None for replicated)
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "length": None,
    "embed": "fsdp",
    "mlp": "tensor",
    "heads": "tensor",
    "vocab": "tensor",
    "position": None,
    "token_type": None,
}


def mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> dict[str, int]:
    """The sizes of the ('data', 'fsdp', 'tensor') axes over `num_devices` devices; -1 takes what the others leave."""
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError("at most one mesh axis may be -1")
    known = int(np.prod([s for s in sizes if s != -1]))
    if -1 in sizes:
        if num_devices % known:
            raise ValueError(f"{num_devices} devices do not split into fsdp={fsdp} x tensor={tensor}")
        sizes[sizes.index(-1)] = num_devices // known
    shape = dict(zip(MESH_AXES, sizes, strict=True))
    if int(np.prod(sizes)) != num_devices:
        raise ValueError(f"mesh {shape} needs {np.prod(sizes)} devices, there are {num_devices}")
    return shape


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh over all devices; -1 takes what the other axes leave."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = list(mesh_shape(data, fsdp, tensor, len(devices)).values())
    return Mesh(np.array(devices).reshape(sizes), MESH_AXES)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    num_devices: int = 0  # 0: every device of every host


def build_mesh(cfg: MeshConfig, global_batch: int, grad_accum: int, batch_key: str) -> Mesh:
    """The device mesh of `cfg`; the micro-batch (global_batch / grad_accum) must split over its batch shards."""
    devices = jax.devices()
    if cfg.num_devices:
        if cfg.num_devices > len(devices):
            raise UserError(f"mesh.num_devices={cfg.num_devices} but there are {len(devices)} devices")
        devices = devices[: cfg.num_devices]
    try:
        mesh = make_mesh(cfg.data, cfg.fsdp, cfg.tensor, devices)
    except ValueError as e:
        raise UserError(f"config 'mesh': {e}") from None
    check_batch_split(dict(mesh.shape), global_batch, grad_accum, batch_key)
    return mesh


def check_batch_split(shape: dict[str, int], global_batch: int, grad_accum: int, batch_key: str) -> None:
    """Refuse a micro-batch (global_batch / grad_accum) that does not split over the mesh's batch shards."""
    shards = shape["data"] * shape["fsdp"]
    micro = global_batch // grad_accum
    if micro % shards:
        raise UserError(
            f"{batch_key}={global_batch} with grad_accum={grad_accum} gives micro-batches of {micro}, which do not "
            f"split over {shards} devices (mesh data x fsdp); use {batch_key} "
            f"{_suggest_batches(global_batch, shards * grad_accum)}"
        )


def _suggest_batches(batch: int, multiple: int) -> str:
    lower = max(multiple, batch // multiple * multiple)
    return f"{lower} or {lower + multiple}"


def logical_to_mesh(axes: tuple[str | None, ...]) -> PartitionSpec:
    return PartitionSpec(*(None if a is None else RULES.get(a) for a in axes))


def spec_for(mesh_shape: Mapping[str, int], axes: tuple[str | None, ...], shape: tuple[int, ...]) -> PartitionSpec:
    """The PartitionSpec of an array with logical `axes` on a mesh of `mesh_shape` ({'data': 8, ...}).

    A dimension that does not divide over its mesh axes stays replicated rather than failing."""
    spec = []
    for dim, mesh_axes in zip(shape, logical_to_mesh(axes), strict=True):
        names = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
        size = int(np.prod([mesh_shape[n] for n in names])) if names else 1
        spec.append(mesh_axes if names and dim % size == 0 else None)
    return PartitionSpec(*spec)


def logical_axes(var: nnx.Variable) -> tuple[str | None, ...]:
    shape = var.get_value().shape  # an array, or a ShapeDtypeStruct under nnx.eval_shape
    return tuple(var.get_metadata().get("out_sharding") or (None,) * len(shape))


def param_shardings(model: nnx.Module, mesh: Mesh) -> nnx.State:
    """NamedSharding for every parameter of `model`, from its logical axis names and RULES."""
    state = nnx.state(model, nnx.Param)

    def one(var: nnx.Variable) -> NamedSharding:
        return NamedSharding(mesh, spec_for(dict(mesh.shape), logical_axes(var), var.get_value().shape))

    return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: Mesh) -> None:
    """Place `model`'s parameters on `mesh` as RULES say, in place."""
    state = nnx.state(model, nnx.Param)
    shardings = param_shardings(model, mesh)
    nnx.update(model, jax.device_put(state, shardings))


# The mesh of the run whose programs are being traced (run_mesh), for kernels that work on each device's part.
_RUN_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("run_mesh", default=None)


@contextlib.contextmanager
def run_mesh(mesh: Mesh) -> Iterator[None]:
    """The mesh of the programs traced inside (in this thread, or in one given a copy of its context)."""
    token = _RUN_MESH.set(mesh)
    try:
        yield
    finally:
        _RUN_MESH.reset(token)


def per_device(
    fn: Callable[..., jax.Array],
    args: tuple[jax.Array, ...],
    axes: tuple[tuple[str | None, ...], ...],
    starts: bool = False,
) -> jax.Array:
    """fn(*args) computed by each device of the run's mesh on its own part of the arrays (shard_map), split as
    their logical `axes` say (the output split as the first argument's); on whole arrays outside a run of
    several devices. For a kernel XLA cannot split itself (a Pallas call), which would gather its operands.
    `starts`: fn also takes starts=, where the device's part of the first argument begins in the whole array
    along each axis ((int32 scalars), zeros on whole arrays), for a kernel whose numbers depend on positions."""
    mesh = _RUN_MESH.get()
    if mesh is None or mesh.size == 1:
        return fn(*args, starts=(jnp.int32(0),) * args[0].ndim) if starts else fn(*args)
    specs = tuple(spec_for(dict(mesh.shape), a, x.shape) for a, x in zip(axes, args, strict=True))

    def part(*local: jax.Array) -> jax.Array:
        if not starts:
            return fn(*local)
        at = zip(specs[0], local[0].shape, strict=True)
        return fn(*local, starts=tuple(_shard_index(mesh, names) * n for names, n in at))

    return jax.shard_map(part, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)


def _shard_index(mesh: Mesh, names: str | tuple[str, ...] | None) -> jax.Array:
    """Inside shard_map: this device's index along an array axis split over mesh axes `names` (major first)."""
    index = jnp.int32(0)
    for name in (names,) if isinstance(names, str) else (names or ()):
        index = index * mesh.shape[name] + jax.lax.axis_index(name)
    return index


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """(B, T) arrays: batch over the data-parallel axes, tokens replicated."""
    return NamedSharding(mesh, logical_to_mesh(("batch", "length")))


def global_array(full: np.ndarray, mesh: Mesh) -> jax.Array:
    """A batch that every process holds whole (B, ...) as one global array split over the data-parallel axes.

    Each process hands over only its own rows, as `jax.make_array_from_process_local_data` expects.
    """
    sharding = NamedSharding(mesh, logical_to_mesh(("batch",) + (None,) * (full.ndim - 1)))
    per = full.shape[0] // jax.process_count()
    local = full[jax.process_index() * per : (jax.process_index() + 1) * per]
    return jax.make_array_from_process_local_data(sharding, local, full.shape)


HEARTBEAT_SECONDS = 30  # a process silent this long is taken for dead and the others stop (JAX's default is 100)


def initialize_distributed() -> bool:
    """Join a multi-host run when the environment describes one; returns whether it did.

    TPU pod slices and SLURM jobs are detected by JAX itself; elsewhere set JAX_COORDINATOR_ADDRESS (host:port of
    process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every host. Nothing else in bertforge changes.
    BERTFORGE_HEARTBEAT_SECONDS sets how soon the others stop when one process dies.
    """
    import os

    env = os.environ
    explicit = "JAX_COORDINATOR_ADDRESS" in env
    slurm = int(env.get("SLURM_NTASKS", "1")) > 1
    tpu_pod = len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1
    if not (explicit or slurm or tpu_pod):
        return False
    timeouts = {"heartbeat_timeout_seconds": int(env.get("BERTFORGE_HEARTBEAT_SECONDS", HEARTBEAT_SECONDS))}
    if explicit:
        jax.distributed.initialize(
            coordinator_address=env["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(env["JAX_NUM_PROCESSES"]) if "JAX_NUM_PROCESSES" in env else None,
            process_id=int(env["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in env else None,
            **timeouts,
        )
    else:
        jax.distributed.initialize(**timeouts)
    return True


def fetch(tree: Any) -> Any:
    """`tree`'s arrays whole, as numpy, on every process: a collective when other processes hold parts of them
    (FSDP over several hosts), so every process must call it."""
    if jax.process_count() == 1:
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def process_0s(value: float) -> float:
    """Process 0's `value`, on every process: a collective, so every process must call it."""
    from jax.experimental import multihost_utils

    return float(multihost_utils.broadcast_one_to_all(np.float32(value)))
