"""Operand layouts for inference (it runs after rewriting, before the split stage, on graphs
compiled without a loss): where a node's kernel reads an input faster in another layout on the
target (OpDef.layouts: a convolution's operands channels-last in f16 for f16 tiles), the input
is copied so by a layout op first and the node reads the copy. One copy serves every node that
wants the same tensor in the same layout. Training keeps the layouts as they are: the backward
pass reads the forward pass's tensors in theirs.
"""

from __future__ import annotations

from vkml.compiler.codegen import value_key
from vkml.compiler.rebuild import Emit, rebuild
from vkml.compiler.rooted import Rooted
from vkml.graph import OPS, Tensor
from vkml.hal import Capabilities


def relayout_operands(rooted: Rooted, caps: Capabilities) -> Rooted:
    """The graph with each node's wanted operand layouts (OpDef.layouts) on `caps`."""
    copies: dict[tuple, Tensor] = {}  # (input's new id, layout op, its attributes) -> the copy

    def copy(x: Tensor, op: str, attrs: dict, emit: Emit) -> Tensor:
        key = (x.id, op, value_key(attrs))
        if key not in copies:
            shape, dtype = OPS[op].infer([x], attrs)
            copies[key] = emit(op, [x], shape, attrs, x, dtype)
        return copies[key]

    def make(node: Tensor, inputs: list[Tensor], emit: Emit) -> Tensor:
        rule = OPS[node.op].layouts
        wanted = rule(node, caps) if rule is not None else None
        if wanted is None:
            return emit(node.op, inputs, node.shape, node.attrs, node)
        layouts, attrs = wanted
        moved = [x if k >= len(layouts) or layouts[k] is None
                 else copy(x, *layouts[k], emit) for k, x in enumerate(inputs)]
        return emit(node.op, moved, node.shape, attrs, node)

    return rebuild(rooted, make)
