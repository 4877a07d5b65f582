"""Fusion by rewriting: Graph -> Graph with fewer, larger kernels.

Greedy rules, applied in topological order until nothing changes. A producer is absorbed into its
consumer only when nothing else needs it in memory: it is not a graph output or gradient, and it
has exactly one consumer, or it is a single elementwise op every consumer of which absorbs it.
- pointwise into pointwise: chains and DAGs of elementwise ops become one `fused_pointwise`
  (one broadcast into a larger one computed again at each of its elements); scalar constants
  become WGSL literals on the way.
- pointwise into a matmul's or a convolution's epilogue: bias add, activation, scaling, batch
  norm's inference form, a residual add happen before the store.
- pointwise into a sum's prologue (the summand) and epilogue (the sum's result), which turns
  cross-entropy and MSE into single row reductions after the softmax.
Runs after autodiff, so forward and backward kernels are fused alike; fused ops need no gradient.

Each pass is linear in the graph: bodies are built with lazy substitutions (vkml/expr.py's
`Subst`), so absorbing a producer costs the same however large its body has grown, and the
bodies of the final graph are materialized once, at the end.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from vkml.compiler.rooted import Rooted
from vkml.expr import Arg, Body, Lazy, Lit, Shape, Subst, contiguous_strides, in_order, materialize
from vkml.graph import OPS, Graph, Tensor, body_of

IDENTITY_EPILOGUE = Body(Arg(0), ((),))
DUPLICATE_INPUTS = 6  # the most buffers an op computed again in each of its consumers reads


class _BodyBuilder:
    """Accumulates one fused body: its external inputs (deduplicated) and its expression."""

    def __init__(self, reserved: int = 0) -> None:
        self.inputs: list[Tensor | None] = [None] * reserved  # None: not a buffer (accumulator)
        self.strides: list[Shape] = [()] * reserved
        self.args: list[Arg] = [Arg(k) for k in range(reserved)]
        self._index: dict[tuple[int, Shape], int] = {}  # (id of tensor, strides) -> input

    def input(self, tensor: Tensor, strides: Shape) -> Arg:
        k = self._index.get((id(tensor), strides))
        if k is not None:
            return self.args[k]
        self._index[id(tensor), strides] = len(self.args)
        self.inputs.append(tensor)
        self.strides.append(strides)
        self.args.append(Arg(len(self.args)))
        return self.args[-1]

    @staticmethod
    def inline(body: Body, args: list[Lazy]) -> Lazy:
        """`body`'s result with its inputs bound to `args` (lazily: see vkml/expr.py)."""
        return Subst(body.result, tuple(args))

    def body(self, result: Lazy) -> Body:
        return Body(result, tuple(self.strides))


def _literal(t: Tensor, values: dict[int, np.ndarray]) -> Lit | None:
    """A literal for a scalar f32 constant, so it needs no buffer and no binding."""
    if t.op != "constant" or t.size != 1 or t.dtype != "f32":
        return None
    value = float(values[t.id].reshape(()))
    return Lit(value) if np.isfinite(value) else None


def fuse(rooted: Rooted, max_inputs: int) -> Rooted:
    """The fused graph. `max_inputs`: the most buffers a fused kernel may read (the device's
    storage bindings per stage, less the output)."""
    changed = True
    while changed:
        rooted, changed = _fuse_once(rooted, max_inputs)
    _materialize_bodies(rooted.graph)
    return rooted


def _materialize_bodies(graph: Graph) -> None:
    """Carry out the lazy substitutions of every body in `graph`. The last pass absorbed
    nothing, so every node of `graph` is live, and each node is its own (new) object: its
    attributes are replaced, never changed in place (earlier graphs share the dicts)."""
    lazy: dict[int, Body] = {}
    for t in graph.nodes:
        for v in t.attrs.values():
            if isinstance(v, Body) and isinstance(v.result, Subst):
                lazy[id(v)] = v
    if not lazy:
        return
    done = dict(zip(lazy, (Body(r, b.strides) for r, b in
                           zip(materialize([b.result for b in lazy.values()]), lazy.values()))))
    for t in graph.nodes:
        if any(id(v) in done for v in t.attrs.values()):
            t.attrs = {k: done.get(id(v), v) for k, v in t.attrs.items()}


def _fuse_once(rooted: Rooted, max_inputs: int) -> tuple[Rooted, bool]:
    old, roots = rooted.graph, rooted.roots
    order = old.reachable(roots)
    pinned = {t.id for t in roots}
    consumers = Counter(i.id for t in order for i in {x.id: x for x in t.inputs}.values())
    duplicable = _duplicable(order, pinned, consumers)
    new = Graph.__new__(Graph)
    new.nodes, new.outputs, new.rng, new.created_at = [], {}, old.rng, old.created_at
    new.initial_values = {}
    new_of: dict[int, Tensor] = {}
    old_of: dict[int, int] = {}
    changed = False

    def absorbable(t: Tensor) -> bool:
        original = old_of[t.id]
        if original in pinned:
            return False
        # a copy goes into each consumer only while it reads few buffers: what it absorbed
        # in this pass goes along, and a residual stream's adds, copied from layer to layer,
        # would otherwise grow into every later kernel; and only while it is elementwise (one
        # that took a product into itself in this pass would compute the product again)
        return consumers[original] == 1 or (original in duplicable
                                            and OPS[t.op].kind == "pointwise"
                                            and len(t.inputs) <= DUPLICATE_INPUTS)

    def emit(template: Tensor, op: str, inputs: list[Tensor], attrs: dict) -> Tensor:
        t = Tensor(new, len(new.nodes), op, tuple(inputs), template.shape, template.dtype, attrs,
                   template.name, template.where)
        new.nodes.append(t)
        return t

    for node in order:
        inputs = [new_of[i.id] for i in node.inputs]
        fused = None
        if OPS[node.op].kind == "pointwise":
            fused = _fuse_pointwise(node, inputs, absorbable, new.initial_values, emit,
                                    max_inputs)
        elif _plain_sum(node):
            fused = _fuse_sum_prologue(node, inputs, absorbable, emit, max_inputs)
        if fused is None:
            fused = emit(node, node.op, inputs, node.attrs)
        else:
            changed = True
        new_of[node.id] = fused
        old_of[fused.id] = node.id
        if node.id in old.initial_values:
            new.initial_values[fused.id] = old.initial_values[node.id]
    new.inputs = {n: new_of[t.id] for n, t in old.inputs.items() if t.id in new_of}
    new.params = {n: new_of[t.id] for n, t in old.params.items() if t.id in new_of}
    new.outputs = {n: new_of[t.id] for n, t in old.outputs.items() if t.id in new_of}
    return rooted.renamed(new, new_of), changed


def _duplicable(order: list[Tensor], pinned: set[int], consumers: Counter[int]) -> set[int]:
    """Elementwise ops (not fused ones, which may have grown large) with several consumers,
    every one of which would absorb them: computed again inside each, they need no kernel and
    no memory of their own. A norm's normalized input, read by its scale and by its weight's
    gradient, is the common case. Not one that reads a product or a sum nothing else reads:
    that would move into its epilogue, and each copy would compute the product again."""
    ok = {t.id: True for t in order if OPS[t.op].kind == "pointwise"
          and t.op != "fused_pointwise" and t.id not in pinned
          and not any(OPS[i.op].fusion is not None and consumers[i.id] == 1 for i in t.inputs)}
    seen: Counter[int] = Counter()
    for c in order:
        strides = body_of(c).strides if OPS[c.op].kind == "pointwise" else ()
        for k, t in enumerate(c.inputs):
            if t.id not in ok:
                continue
            seen[t.id] += 1
            if OPS[c.op].kind == "pointwise":
                ok[t.id] &= (in_order(strides[k], c.shape) if t.shape == c.shape
                             else _broadcast_inlinable(t))
            else:
                ok[t.id] &= _plain_sum(c)
    return {i for i, fits in ok.items() if fits and seen[i] > 1}


def _plain_sum(t: Tensor) -> bool:
    """A sum the rewrite has not fused yet: a pointwise summand may move into it."""
    opdef = OPS[t.op]
    return opdef.fusion == "sum" and opdef.unfused is None


def _broadcast_inlinable(t: Tensor) -> bool:
    """Whether pointwise `t` can be computed again inside a larger op that reads it broadcast:
    it reads each of its inputs at its own index, so the larger op reads them at the strides
    it reads `t` at."""
    return all(in_order(s, t.shape) for s in body_of(t).strides)


def _fuse_pointwise(node, inputs, absorbable, values, emit, max_inputs) -> Tensor | None:
    body = body_of(node)
    builder = _BodyBuilder()
    args, changed = [], False
    for t, strides in zip(inputs, body.strides):
        literal = _literal(t, values)
        if literal is not None:
            args.append(literal)
            changed = True
        elif (OPS[t.op].kind == "pointwise" and t.shape == node.shape
              and in_order(strides, node.shape) and absorbable(t)):
            producer = body_of(t)
            args.append(builder.inline(producer, [builder.input(x, s) for x, s in
                                                  zip(t.inputs, producer.strides)]))
            changed = True
        elif (OPS[t.op].kind == "pointwise" and t.shape != node.shape and absorbable(t)
              and _broadcast_inlinable(t)):
            # A smaller op broadcast into this one (batch norm's scale and shift, per channel,
            # from its running statistics) is computed again at each element: its inputs are
            # read at its own index, so here at the strides this op reads it at. A few
            # arithmetic ops an element cost less than its own dispatch and store.
            args.append(builder.inline(body_of(t), [builder.input(x, strides)
                                                    for x in t.inputs]))
            changed = True
        else:
            args.append(builder.input(t, strides))
    result = builder.inline(body, args)
    if len(builder.inputs) > max_inputs:
        return None

    # Now the whole computation may move into a matmul's or a sum's epilogue; a sum's seen
    # through a reshape too (a norm's statistics, kept with keepdims), which it then has. Not
    # one that changes the dtype (a cast to i32 after a product): those kernels store f32.
    for k, (t, strides) in enumerate(zip(builder.inputs, builder.strides)):
        host = (t.inputs[0] if OPS[t.op].kind == "view" and _sum_without_epilogue(t.inputs[0])
                and absorbable(t) else t)
        if (OPS[host.op].fusion is not None and t.shape == node.shape
                and in_order(strides, node.shape) and absorbable(host)
                and node.dtype == host.dtype):
            inputs = [host if j == k else x for j, x in enumerate(builder.inputs)]
            absorbed = _absorb_into_epilogue(node, host, k, builder.body(result), inputs, emit,
                                             max_inputs)
            if absorbed is not None:
                return absorbed
    if not changed:
        return None
    return emit(node, "fused_pointwise", [t for t in builder.inputs if t is not None],
                {"body": builder.body(result), "shape": node.shape, "dtype": node.dtype})


def _sum_without_epilogue(t: Tensor) -> bool:
    """A sum whose result is stored as it is, so it may be stored in any shape of its size
    (an epilogue's reads are laid out by the result's shape)."""
    return OPS[t.op].fusion == "sum" and (_plain_sum(t)
                                          or t.attrs["epilogue"] is IDENTITY_EPILOGUE)


def _absorb_into_epilogue(node: Tensor, producer: Tensor, slot: int, body: Body,
                          body_inputs: list, emit, max_inputs: int) -> Tensor | None:
    """`node` (as `body` over `body_inputs`, of which input `slot` is `producer`) becomes
    `producer`'s epilogue; None where the kernel would read more than `max_inputs` buffers."""
    product = OPS[producer.op].fusion == "product"
    if product:
        leading = list(producer.inputs[:2])
        old_epilogue = producer.attrs.get("epilogue", IDENTITY_EPILOGUE)
        extras = list(producer.inputs[2:])
    else:
        attrs = _as_fused_sum(producer)
        leading = list(producer.inputs[:attrs["n_prologue"]])
        old_epilogue = attrs["epilogue"]
        extras = list(producer.inputs[attrs["n_prologue"]:])
    builder = _BodyBuilder(reserved=1)
    previous = builder.inline(old_epilogue, [builder.args[0]] + [
        builder.input(x, s) for x, s in zip(extras, old_epilogue.strides[1:])])
    args = [previous if k == slot else builder.input(t, s)
            for k, (t, s) in enumerate(zip(body_inputs, body.strides))]
    epilogue = builder.body(builder.inline(body, args))
    inputs = leading + [t for t in builder.inputs[1:] if t is not None]
    if len(inputs) > max_inputs:
        return None
    if product:
        attrs = {**producer.attrs, "epilogue": epilogue, "shape": node.shape, "dtype": node.dtype}
    else:
        attrs = {**_as_fused_sum(producer), "epilogue": epilogue, "shape": node.shape,
                 "dtype": node.dtype}
    return emit(node, OPS[producer.op].fused, inputs, attrs)


def _as_fused_sum(t: Tensor) -> dict:
    """The fused sum's attributes of a plain or fused sum."""
    if not _plain_sum(t):
        return dict(t.attrs)
    (x,) = t.inputs
    return {"axes": t.attrs["axes"], "in_shape": x.shape, "n_prologue": 1,
            "prologue": Body(Arg(0), (contiguous_strides(x.shape),)),
            "epilogue": IDENTITY_EPILOGUE, "shape": t.shape, "dtype": t.dtype}


def _fuse_sum_prologue(node, inputs, absorbable, emit, max_inputs) -> Tensor | None:
    """sum(pointwise(...)) -> one reduction whose summand is computed as it is read."""
    (summand,) = inputs
    if (OPS[summand.op].kind != "pointwise" or not absorbable(summand)
            or len(summand.inputs) > max_inputs):
        return None
    # The prologue reads each input through the summand's strides (broadcast ones included).
    attrs = {**_as_fused_sum(node), "prologue": body_of(summand),
             "n_prologue": len(summand.inputs)}
    return emit(node, OPS[node.op].fused, list(summand.inputs), attrs)
