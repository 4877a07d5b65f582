"""Scale the backward pass's f16 products (accelerated mode; it runs after the split stage, before
scheduling): gradients often lie far below f16's smallest normal (6e-5), Whisper's attention
gradients around 1e-7, and converting them to f16 as they are would flush them to zero. So each
matrix product of the backward pass that takes f16 tiles gets, for each operand that
is not a forward-pass tensor (every operand, where products compute in f16 arithmetic:
Capabilities.f16_products "simt"), the largest finite magnitude of each of its rows in memory
(one `abs_max` over its last axis, read along memory, shared by every product that reads the same
tensor) as an extra input, attribute "scales" saying how the kernel reads them: "rows" where
the operand's rows in memory are the product's rows (A) or columns (B), so each gets a power
of two of its own; "depth" where they run along the sum, so the kernel takes the largest over
its range of k (vkml/kernels/gemm.py `Scale`). The forward pass's products are left as they
are: activations and parameters sit well inside f16's range.
"""

from __future__ import annotations

from vkml.compiler.codegen import phase_target
from vkml.compiler.rebuild import Emit, rebuild
from vkml.compiler.rooted import Rooted
from vkml.graph import OPS, Tensor
from vkml.hal import Capabilities


def scale_operands(rooted: Rooted, caps: Capabilities) -> Rooted:
    """The graph with the backward pass's cooperative products scaled (nodes the outputs
    depend on are the forward pass)."""
    forward = {t.id for t in rooted.graph.reachable(rooted.outputs.values())}
    backward = phase_target(caps, False)
    magnitudes: dict[int, Tensor] = {}  # new tensor id -> the largest magnitude of each row

    def magnitude(x: Tensor, emit: Emit) -> Tensor:
        if x.id not in magnitudes:
            magnitudes[x.id] = emit("abs_max", [x], x.shape[:-1], {"axes": (len(x.shape) - 1,)},
                                    x)
        return magnitudes[x.id]

    def make(node: Tensor, inputs: list[Tensor], emit: Emit) -> Tensor:
        scaled = OPS[node.op].scaled
        if (scaled is not None and node.id not in forward and backward.scaled_operands
                and scaled(node, backward)):
            ta, tb = node.attrs["transpose_a"], node.attrs["transpose_b"]
            # f16 arithmetic (staged f16 tiles) scales the forward pass's operand too: its
            # products and sums are f16 as well
            every = backward.f16_products == "simt"
            modes = tuple(None if x.id in forward and not every
                          else "rows" if per_row else "depth"
                          for x, per_row in zip(node.inputs[:2], (not ta, tb)))
            if any(modes):
                a, b, *extras = inputs
                scales = [magnitude(x, emit) for x, mode in zip((a, b), modes) if mode]
                return emit(node.op, [a, b, *scales, *extras], node.shape,
                            {**node.attrs, "scales": modes}, node)
        return emit(node.op, inputs, node.shape, node.attrs, node)

    return rebuild(rooted, make)
