"""What every reference model's `build()` returns, and the helpers the models share."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from vkml.graph import Graph, Tensor


@dataclass
class Built:
    """A model's graph ready to compile: `vkml.compile(b.graph, loss=b.loss,
    outputs=b.outputs, optimizer=...)`; `sample_inputs(rng)` gives a valid input of every name
    in `inputs` (random data of the right shapes, dtypes and ranges)."""
    graph: Graph
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    loss: Tensor
    sample_inputs: Callable[[np.random.Generator], dict[str, np.ndarray]]
    notes: dict[str, str] = field(default_factory=dict)


def linear(g: Graph, name: str, x: Tensor, in_features: int, out_features: int,
           bias: bool = True, std: float | None = None) -> Tensor:
    """x (..., in) @ W^T (+ b), W `name.weight` of shape (out, in) as torch.nn.Linear; the
    leading axes are flattened into one matrix product and restored. `std`: a normal init
    (Hugging Face's initializer_range) instead of torch.nn.Linear's uniform one."""
    if std is None:
        bound = 1.0 / math.sqrt(in_features)
        w = g.param(f"{name}.weight", (out_features, in_features), "uniform", bound)
        b = g.param(f"{name}.bias", (out_features,), "uniform", bound) if bias else None
    else:
        w = g.param(f"{name}.weight", (out_features, in_features), "normal", std)
        b = g.param(f"{name}.bias", (out_features,)) if bias else None
    lead = x.shape[:-1]
    y = g.matmul(g.reshape(x, (-1, in_features)) if len(lead) != 1 else x, w, transpose_b=True)
    if b is not None:
        y = g.bias_add(y, b)
    return g.reshape(y, (*lead, out_features)) if len(lead) != 1 else y


def heads(g: Graph, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """(B, S, n*d) -> (B, n, S, d)."""
    b, s, _ = x.shape
    return g.transpose(g.reshape(x, (b, s, n_heads, head_dim)), (0, 2, 1, 3))


def merge_heads(g: Graph, x: Tensor) -> Tensor:
    """(B, n, S, d) -> (B, S, n*d)."""
    b, n, s, d = x.shape
    return g.reshape(g.transpose(x, (0, 2, 1, 3)), (b, s, n * d))
