"""Rows of the key-name tables that map Hugging Face parameter names to paths in a bertforge model."""

from __future__ import annotations

import dataclasses
from typing import Any

ParamPath = tuple[Any, ...]  # a path in nnx.to_pure_dict(nnx.state(model, nnx.Param))


@dataclasses.dataclass(frozen=True)
class Row:
    hf: str  # Hugging Face parameter name
    path: ParamPath
    transpose: bool  # torch Linear stores (out, in); Flax kernels are (in, out)
    head: bool  # part of a task head, may be absent from an encoder-only checkpoint


def linear_rows(hf: str, path: ParamPath, head: bool = False, bias: bool = True) -> list[Row]:
    """The weight (and bias) of a torch Linear `hf` as the kernel (and bias) at `path`."""
    rows = [Row(f"{hf}.weight", (*path, "kernel"), True, head)]
    return rows + [Row(f"{hf}.bias", (*path, "bias"), False, head)] if bias else rows


def layernorm_rows(hf: str, path: ParamPath, head: bool = False, bias: bool = True) -> list[Row]:
    """The weight (and bias) of a torch LayerNorm `hf` as the scale (and bias) at `path`."""
    rows = [Row(f"{hf}.weight", (*path, "scale"), False, head)]
    return rows + [Row(f"{hf}.bias", (*path, "bias"), False, head)] if bias else rows


def table_row(hf: str, path: ParamPath) -> Row:
    """An embedding table `hf` (a torch Embedding's weight) as the embedding at `path`."""
    return Row(f"{hf}.weight", (*path, "embedding"), False, False)
