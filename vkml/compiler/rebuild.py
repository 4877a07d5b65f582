"""A new graph from an old one, node by node: how the stages after rewriting (compiler/split.py,
compiler/scale.py) replace nodes, each a function of the node and its inputs' replacements."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from vkml.graph import Graph, Shape, Tensor

# emit(op, inputs, shape, attrs, template) -> the new node (dtype, name and source line taken
# from `template`)
Emit = Callable[[str, list[Tensor], Shape, dict, Tensor], Tensor]
# make(node, its inputs' replacements, emit) -> the node's replacement
Make = Callable[[Tensor, list[Tensor], Emit], Tensor]


def rebuild(old: Graph, roots: Iterable[Tensor], make: Make) -> tuple[Graph, dict[int, Tensor]]:
    """A new graph of the nodes `roots` depend on: each node's replacement is `make(node, its
    inputs' replacements, emit)`, where `emit` appends a node. Returns the graph and a map from
    old node ids to new nodes."""
    new = Graph.__new__(Graph)
    new.nodes, new.rng, new.initial_values, new.created_at = [], old.rng, {}, old.created_at
    new_of: dict[int, Tensor] = {}

    def emit(op: str, inputs: list[Tensor], shape: Shape, attrs: dict,
             template: Tensor) -> Tensor:
        t = Tensor(new, len(new.nodes), op, tuple(inputs), shape, template.dtype, attrs,
                   template.name, template.where)
        new.nodes.append(t)
        return t

    for node in old.reachable(roots):
        new_of[node.id] = make(node, [new_of[i.id] for i in node.inputs], emit)
        if node.id in old.initial_values:
            new.initial_values[new_of[node.id].id] = old.initial_values[node.id]
    new.inputs = {n: new_of[t.id] for n, t in old.inputs.items() if t.id in new_of}
    new.params = {n: new_of[t.id] for n, t in old.params.items() if t.id in new_of}
    new.outputs = {n: new_of[t.id] for n, t in old.outputs.items() if t.id in new_of}
    return new, new_of
