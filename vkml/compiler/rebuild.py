"""A new graph from an old one, node by node: how the stages after rewriting (compiler/compose.py,
compiler/split.py, compiler/scale.py) replace nodes, each a function of the node and its inputs'
replacements."""

from __future__ import annotations

from collections.abc import Callable

from vkml.compiler.rooted import Rooted
from vkml.graph import DType, Graph, Shape, Tensor

# emit(op, inputs, shape, attrs, template, dtype=None) -> the new node (name, source line and,
# unless given, dtype taken from `template`)
Emit = Callable[..., Tensor]
# make(node, its inputs' replacements, emit) -> the node's replacement
Make = Callable[[Tensor, list[Tensor], Emit], Tensor]


def rebuild(old: Rooted, make: Make) -> Rooted:
    """A new graph of the nodes the roots depend on: each node's replacement is `make(node, its
    inputs' replacements, emit)`, where `emit` appends a node; the roots are the replacements
    of the old ones."""
    graph = old.graph
    new = Graph.__new__(Graph)
    new.nodes, new.rng, new.initial_values, new.created_at = [], graph.rng, {}, graph.created_at
    new_of: dict[int, Tensor] = {}

    def emit(op: str, inputs: list[Tensor], shape: Shape, attrs: dict,
             template: Tensor, dtype: DType | None = None) -> Tensor:
        t = Tensor(new, len(new.nodes), op, tuple(inputs), shape, dtype or template.dtype, attrs,
                   template.name, template.where)
        new.nodes.append(t)
        return t

    for node in graph.reachable(old.roots):
        new_of[node.id] = make(node, [new_of[i.id] for i in node.inputs], emit)
        if node.id in graph.initial_values:
            new.initial_values[new_of[node.id].id] = graph.initial_values[node.id]
    new.inputs = {n: new_of[t.id] for n, t in graph.inputs.items() if t.id in new_of}
    new.params = {n: new_of[t.id] for n, t in graph.params.items() if t.id in new_of}
    new.outputs = {n: new_of[t.id] for n, t in graph.outputs.items() if t.id in new_of}
    return old.renamed(new, new_of)
