"""Reverse-mode automatic differentiation: Graph + scalar loss -> the same graph extended with
gradient nodes, one gradient tensor per parameter.

Gradients are built from ordinary ops through each op's `grad` rule, so the backward pass goes
through the same rewrite, planning and codegen stages as the forward pass.
"""

from __future__ import annotations

from vkml.compiler.options import CompileOptions
from vkml.compiler.rooted import Rooted
from vkml.errors import GraphError
from vkml.graph import OPS, Graph, Tensor


def gradients(graph: Graph, loss: Tensor, params: dict[str, Tensor] | None = None
              ) -> dict[str, Tensor]:
    """Append the backward pass of `loss` to `graph`; returns parameter name -> gradient node.

    A parameter the loss does not depend on gets no gradient and is left out, as PyTorch
    leaves its `.grad` None (and torch.optim then skips it: no update, no weight decay)."""
    if loss.shape != ():
        raise GraphError(f"the loss must be a scalar; {loss.label} has shape {loss.shape}. "
                         "Reduce it first, e.g. with .mean()")
    params = graph.params if params is None else params
    forward = graph.reachable([loss])
    wanted = {p.id for p in params.values()}
    # Only nodes on a path from a parameter to the loss need a gradient, and only f32 ones:
    # an integer (an index computed from the model's values, a histogram's bin) carries none.
    needs_grad: set[int] = set()
    for node in forward:
        if node.dtype == "f32" and (node.id in wanted
                                    or any(i.id in needs_grad for i in node.inputs)):
            needs_grad.add(node.id)

    grad_of: dict[int, Tensor] = {loss.id: graph.constant(1.0)}
    for node in reversed(forward):
        upstream = grad_of.get(node.id)
        if upstream is None or not node.inputs:
            continue
        rule = OPS[node.op].grad
        targets = [i for i in node.inputs if i.id in needs_grad]
        if not targets:
            continue
        if rule is None:
            raise GraphError(f"{node.label} (made at {node.where}) has no gradient rule, but a "
                             "parameter's gradient flows through it")
        first_new = len(graph.nodes)
        input_grads = rule(graph, node, upstream)
        for made in graph.nodes[first_new:]:  # dumps and errors point at the forward op
            made.where = f"grad of {node.where}"
        for inp, g in zip(node.inputs, input_grads):
            if g is None or inp.id not in needs_grad:
                continue
            previous = grad_of.get(inp.id)
            grad_of[inp.id] = g if previous is None else graph.add(previous, g)

    return {name: grad_of[p.id] for name, p in params.items() if p.id in grad_of}


def differentiate(graph: Graph, options: CompileOptions) -> Rooted:
    """The first stage: a copy of `graph` with the backward pass of the options' loss appended
    (none without one), rooted at what the compilation computes by name and at the trained
    parameters' gradients."""
    work = graph.copy()
    named = options.named(graph)
    grads = (gradients(work, options.loss, options.trained(graph))
             if options.loss is not None else {})
    return Rooted(work, named, grads)
