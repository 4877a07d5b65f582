"""Layers: small helpers that create named parameters and apply ops, named as PyTorch names them
so that checkpoints load by name."""

from __future__ import annotations

import math

from vkml.graph import Graph, Tensor, as_shape


class Linear:
    """y = x @ W^T + b with W `name.weight` of shape (out, in) as torch.nn.Linear; x may have
    any number of leading axes (flattened into one matrix product and restored). Initialised
    like torch.nn.Linear, or with `std`: a normal weight and zero bias (Hugging Face's
    initializer_range). `trainable=False` builds both frozen."""

    def __init__(self, graph: Graph, name: str, in_features: int, out_features: int,
                 bias: bool = True, std: float | None = None, trainable: bool = True) -> None:
        self.graph, self.in_features, self.out_features = graph, in_features, out_features
        as_shape((out_features, in_features), f"Linear '{name}'", what="(out, in) features")
        if std is None:
            bound = 1.0 / math.sqrt(in_features)
            w_init, w_scale, b_init, b_scale = "uniform", bound, "uniform", bound
        else:
            w_init, w_scale, b_init, b_scale = "normal", std, "zeros", 1.0
        self.weight = graph.param(f"{name}.weight", (out_features, in_features), w_init,
                                  w_scale, trainable)
        self.bias = (graph.param(f"{name}.bias", (out_features,), b_init, b_scale, trainable)
                     if bias else None)

    def __call__(self, x: Tensor) -> Tensor:
        g = self.graph
        lead = x.shape[:-1]
        flat = g.reshape(x, (-1, self.in_features)) if len(lead) != 1 else x
        y = g.matmul(flat, self.weight, transpose_b=True)
        if self.bias is not None:
            y = g.bias_add(y, self.bias)
        return g.reshape(y, (*lead, self.out_features)) if len(lead) != 1 else y


def linear(g: Graph, name: str, x: Tensor, in_features: int, out_features: int,
           bias: bool = True, std: float | None = None, trainable: bool = True) -> Tensor:
    """Linear(g, name, in_features, out_features, bias, std, trainable)(x) in one call."""
    return Linear(g, name, in_features, out_features, bias, std, trainable)(x)
