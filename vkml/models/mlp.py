"""A multilayer perceptron: Linear layers with an activation between them."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from vkml.errors import GraphError
from vkml.graph import Graph, Tensor
from vkml.nn import Linear

ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": Tensor.relu, "gelu": Tensor.gelu, "silu": Tensor.silu,
    "tanh": Tensor.tanh, "sigmoid": Tensor.sigmoid,
}


def mlp(graph: Graph, x: Tensor, sizes: Sequence[int], activation: str = "relu") -> Tensor:
    """Logits of an MLP on `x` (batch, sizes[0]) with layer widths `sizes`, e.g. (256, 128, 6).

    Layers are named fc1, fc2, ... (parameters "fc1.weight", "fc1.bias", ...), as a PyTorch
    module with attributes fc1, fc2 names them, so its state_dict loads by name. No activation
    follows the last layer: its output is logits.
    """
    if len(sizes) < 2:
        raise GraphError(f"mlp: sizes {tuple(sizes)} needs an input and an output width")
    if x.shape[-1:] != (sizes[0],):
        raise GraphError(f"mlp: input {x.label} must have {sizes[0]} features (sizes[0])")
    if activation not in ACTIVATIONS:
        raise GraphError(f"mlp: unknown activation {activation!r}; use one of "
                         f"{sorted(ACTIVATIONS)}")
    act = ACTIVATIONS[activation]
    h = x
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:]), start=1):
        h = Linear(graph, f"fc{i}", n_in, n_out)(h)
        if i < len(sizes) - 1:
            h = act(h)
    return h
