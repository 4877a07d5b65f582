"""Layers: small helpers that create named parameters and apply ops, named as PyTorch names
them so that checkpoints load by name."""

from __future__ import annotations

import math

from vkml.graph import Graph, Tensor


class Linear:
    """y = x @ W^T + b with W of shape (out, in), initialised like torch.nn.Linear."""

    def __init__(self, graph: Graph, name: str, in_features: int, out_features: int,
                 bias: bool = True) -> None:
        self.graph = graph
        bound = 1.0 / math.sqrt(in_features)
        self.weight = graph.param(f"{name}.weight", (out_features, in_features), "uniform", bound)
        self.bias = graph.param(f"{name}.bias", (out_features,), "uniform", bound) if bias else None

    def __call__(self, x: Tensor) -> Tensor:
        y = self.graph.matmul(x, self.weight, transpose_b=True)
        return self.graph.bias_add(y, self.bias) if self.bias is not None else y
