"""What every reference model's `build()` returns, and the helpers the models share."""

from __future__ import annotations

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


def heads(g: Graph, x: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """(B, S, n*d) -> (B, n, S, d)."""
    b, s, _ = x.shape
    return g.transpose(g.reshape(x, (b, s, n_heads, head_dim)), (0, 2, 1, 3))


def merge_heads(g: Graph, x: Tensor) -> Tensor:
    """(B, n, S, d) -> (B, S, n*d)."""
    b, n, s, d = x.shape
    return g.reshape(g.transpose(x, (0, 2, 1, 3)), (b, s, n * d))
