"""Split long sums, the one device-aware graph stage (it runs after rewriting, before scheduling):
a matrix product or convolution whose output tiles are too few to fill the device, or whose sum
is longer than the device's loops may run, becomes partial sums over splits of its sum (one
kernel with a leading "split" axis: more workgroups, each a shorter chain of dependent steps)
followed by their sum, which takes over the product's fused epilogue.

Which products qualify, and into how many splits, is each op's `OpDef.splits` for the device
(most ask the GEMM core, vkml/kernels/gemm.py).
"""

from __future__ import annotations

from vkml.compiler.codegen import phase_target
from vkml.compiler.rebuild import Emit, rebuild
from vkml.compiler.rooted import Rooted
from vkml.expr import Arg, Body, contiguous_strides
from vkml.graph import OPS, Tensor
from vkml.hal import Capabilities


def split_sums(rooted: Rooted, caps: Capabilities) -> Rooted:
    """The graph with long sums split. Nodes the outputs depend on are the forward pass; the
    others are split as the kernels the backward pass's target makes of them
    (codegen.phase_target: scaled operands)."""
    forward = {t.id for t in rooted.graph.reachable(rooted.outputs.values())}

    def make(node: Tensor, inputs: list[Tensor], emit: Emit) -> Tensor:
        rule = OPS[node.op].splits
        pieces = rule(node, phase_target(caps, node.id in forward)) if rule is not None else 1
        if pieces > 1:
            return _split(node, inputs, pieces, emit)
        return emit(node.op, inputs, node.shape, node.attrs, node)

    return rebuild(rooted, make)


def _split(node: Tensor, inputs: list[Tensor], pieces: int, emit: Emit) -> Tensor:
    """Partial sums (a leading axis of `pieces`), then their sum through the node's epilogue."""
    unfused = OPS[node.op].unfused
    if unfused is not None:  # the product alone; the sum takes over the epilogue
        op, operands, extras = unfused, inputs[:2], inputs[2:]
        attrs = {k: v for k, v in node.attrs.items() if k not in ("epilogue", "shape", "dtype")}
        epilogue = node.attrs["epilogue"]
    else:
        op, operands, extras, attrs = node.op, inputs, [], dict(node.attrs)
        epilogue = Body(Arg(0), ((),))
    shape = (pieces, *node.shape)
    partial = emit(op, operands, shape, {**attrs, "splits": pieces}, node)
    summed = {"axes": (0,), "in_shape": shape, "n_prologue": 1,
              "prologue": Body(Arg(0), (contiguous_strides(shape),)), "epilogue": epilogue,
              "shape": node.shape, "dtype": node.dtype}
    return emit("fused_sum", [partial, *extras], node.shape, summed, node)
